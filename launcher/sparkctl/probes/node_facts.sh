# sparkctl node facts probe: every read-only fact `check` needs, in ONE round trip.
#
# Run on the node as:
#   sh -s -- NONCE [model=DIR] [cluster=NAME] [docker=no] [banner=no] [listening=no] [df=PATH]...
#              [api=PATH]... [image=REF]... [reach=PORT] < node_facts.sh
# (with reach=PORT, probes/reach.sh is sent ahead of this script: see the end)
# Prints one section per fact, framed by lines that carry the caller's random NONCE (so nothing a
# node prints -- a file name, a container label -- can forge a section boundary):
#   stdout:  @@sparkctl NONCE begin NAME      then the command's stdout
#            @@sparkctl NONCE end NAME RC
#   stderr:  @@sparkctl NONCE stderr NAME     then the command's stderr
# The command's stderr goes straight to the probe's stderr (a stream of its own over SSH): no
# subshell per section to capture it. (One subshell gathers all of round 1's stdout, which then
# leaves in one write; see facts() below.)
# Every value arrives as a positional argument (quoted by the caller) and is only ever expanded in
# double quotes: a model path like '$(touch x)' is a path, never a command.
# Hardware seams: sysfs from ${SPARKCTL_SYSFS_ROOT:-/sys/class/infiniband}; nvidia-smi and docker
# from PATH; docker talks to the session's DOCKER_HOST. POSIX sh only (dash on Debian/Ubuntu).

NONCE=$1
shift
MODEL=
CLUSTER=sparkctl
OFF=' ' # the optional facts' switches turned off (SWITCH=no), space-separated
REACH=
DF_PATHS=
API_PATHS=
# Split key=value arguments; the image references are rebuilt into "$@" (sh has no arrays).
for a do
    shift
    case $a in
        model=*) MODEL=${a#model=} ;;
        cluster=*) CLUSTER=${a#cluster=} ;;
        reach=*) REACH=${a#reach=} ;;
        df=*) DF_PATHS="$DF_PATHS
${a#df=}" ;;
        api=*) API_PATHS="$API_PATHS
${a#api=}" ;;
        image=*) set -- "$@" "${a#image=}" ;;
        *=no) OFF="$OFF${a%=no} " ;; # docker=no, banner=no, listening=no: see sparkctl.facts.node_facts.NodeFacts
    esac
done
# on SWITCH: the optional facts of SWITCH were not turned off
on() {
    case $OFF in *" $1 "*) return 1 ;; esac
}

# A wedged nvidia-smi or docker engine must not hang the whole check.
if command -v timeout >/dev/null 2>&1; then T="timeout -k 2 20"; else T=; fi
NL='
'
# Few processes: every node of a check runs this at once (on the lab, all on one machine's CPUs),
# so no section is captured through a subshell of its own and simple reads use builtins.
section() {
    _name=$1
    shift
    printf '@@sparkctl %s stderr %s\n' "$NONCE" "$_name" >&2
    printf '@@sparkctl %s begin %s\n' "$NONCE" "$_name"
    "$@" </dev/null # stdin is this script's (and then the caller's reply): no command may read it
    _rc=$?
    printf '\n@@sparkctl %s end %s %d\n' "$NONCE" "$_name" "$_rc"
}

# The processes holding GPU memory (pid, name, MiB), then per pid: "@@ended PID" when it has exited (no
# /proc/PID, or a zombie) and the driver still lists it (its memory not given back yet), else "@@cgroup
# PID ID" when a Docker container's cgroup holds it, and "@@container ID<TAB>NAME<TAB>CLUSTER" (its
# name and sparkctl.cluster label, from docker inspect when it answers). Parsed by
# sparkctl.facts.node_facts.parse_compute_apps; nvidia-smi's status is the section's.
gpu_apps() {
    # shellcheck disable=SC2086 # $T is a command prefix (timeout) or nothing
    _apps=$($T nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits) || return $?
    [ -n "$_apps" ] || return 0
    printf '%s\n' "$_apps"
    printf '%s\n' "$_apps" | while IFS=, read -r _pid _rest; do
        _pid=$(printf '%s' "$_pid" | tr -d ' ')
        case $_pid in '' | *[!0-9]*) continue ;; esac
        _state=$(sed -n 's/^State:[[:space:]]*\(.\).*/\1/p' "/proc/$_pid/status" 2>/dev/null)
        if [ -z "$_state" ] || [ "$_state" = Z ]; then
            printf '@@ended %s\n' "$_pid"
            continue
        fi
        _cid=$(sed -n 's/.*[/-]\([0-9a-f]\{64\}\)\(\.scope\)\{0,1\}$/\1/p' "/proc/$_pid/cgroup" 2>/dev/null | head -n 1)
        [ -n "$_cid" ] || continue
        printf '@@cgroup %s %s\n' "$_pid" "$_cid"
        # shellcheck disable=SC2086
        _who=$($T docker inspect --format '{{.Name}}	{{index .Config.Labels "sparkctl.cluster"}}' "$_cid" </dev/null 2>/dev/null) &&
            printf '@@container %s\t%s\n' "$_cid" "$_who"
    done
    return 0
}

# One record per line, tab-separated (parsed by sparkctl.facts.node_facts.parse_infiniband).
ib_walk() {
    root=${SPARKCTL_SYSFS_ROOT:-/sys/class/infiniband}
    if [ ! -d "$root" ]; then
        echo "no RDMA devices: $root does not exist" >&2
        return 3
    fi
    for h in "$root"/*; do
        [ -e "$h" ] || continue
        n=${h##*/}
        printf 'hca\t%s\n' "$n"
        for d in "$h"/device/net/*; do
            [ -e "$d" ] && printf 'netdev\t%s\t%s\n' "$n" "${d##*/}"
        done
        for p in "$h"/ports/*; do
            [ -d "$p" ] || continue
            st=
            ll=
            { read -r st <"$p/state"; } 2>/dev/null
            { read -r ll <"$p/link_layer"; } 2>/dev/null
            printf 'port\t%s\t%s\t%s\t%s\n' "$n" "${p##*/}" "$st" "$ll"
            for g in "$p"/gids/*; do
                gid=
                { read -r gid <"$g"; } 2>/dev/null
                # Only IPv4-mapped GIDs matter (RoCE v2 over the fabric IP); a CX7 has 255 more slots.
                case $gid in 0000:0000:0000:0000:0000:ffff:*) ;; *) continue ;; esac
                i=${g##*/}
                t=
                nd=
                { read -r t <"$p/gid_attrs/types/$i"; } 2>/dev/null
                { read -r nd <"$p/gid_attrs/ndevs/$i"; } 2>/dev/null
                printf 'gid\t%s\t%s\t%s\t%s\t%s\t%s\n' "$n" "${p##*/}" "$i" "$gid" "$t" "$nd"
            done
        done
    done
}

# The kernel's release and command line. $SPARKCTL_KERNEL_SEAM (a lab host's) may hold files that stand
# in for them: release, cmdline. Builtins only (no uname fork).
kernel_info() {
    _ks=${SPARKCTL_KERNEL_SEAM:-}
    _kr=/proc/sys/kernel/osrelease
    _kc=/proc/cmdline
    [ -n "$_ks" ] && [ -r "$_ks/release" ] && _kr=$_ks/release
    [ -n "$_ks" ] && [ -r "$_ks/cmdline" ] && _kc=$_ks/cmdline
    _r=
    _c=
    read -r _r <"$_kr" || return 1
    { read -r _c <"$_kc"; } 2>/dev/null
    printf 'release\t%s\ncmdline\t%s\n' "$_r" "$_c"
}

# Each RDMA device's firmware (sysfs fw_ver, as `ethtool -i` prints it for the port), one per line.
fw_walk() {
    root=${SPARKCTL_SYSFS_ROOT:-/sys/class/infiniband}
    for h in "$root"/*; do
        [ -r "$h/fw_ver" ] || continue
        _f=
        { read -r _f <"$h/fw_ver"; } 2>/dev/null
        printf '%s\t%s\n' "${h##*/}" "$_f"
    done
    return 0
}

# The fabric document `sparkctl setup` wrote (nothing when it never ran here).
fabric_record() {
    _f="${SPARKCTL_SETUP_ROOT:-}/etc/sparkctl/$CLUSTER/fabric.json"
    [ -e "$_f" ] || return 0
    read_file "$_f"
}

model_listing() {
    if [ ! -d "$MODEL" ]; then
        echo missing
        return 0
    fi
    # Top level (the shards, config.json) and one level down (serving/, lm_head-6bit/). A path holding a
    # newline is withheld ("unlisted"): printed, it could forge another file's line (the facts leave
    # through a shell variable, which cannot carry NUL framing; sparkctl.facts.node_facts.parse_model_listing).
    find "$MODEL/" -maxdepth 2 -type f \( -path "*$NL*" -printf 'unlisted\n' -o -printf '%s\t%P\n' \)
}

# The engine's own data root (`docker info`'s DockerRootDir), over its socket when it can.
docker_root() {
    if command -v curl >/dev/null 2>&1 && engine_socket; then
        _i=$(curl -sS --max-time 10 --unix-socket "$SOCK" http://docker/info) || return 1
        _r=${_i#*\"DockerRootDir\":\"}
        [ "$_r" != "$_i" ] || return 1
        _r=${_r%%\"*}
    else
        _r=$($T docker info --format '{{.DockerRootDir}}') || return 1
    fi
    [ -n "$_r" ] && printf '%s\n' "$_r"
}

# One line per df= argument: what was asked, the path it stands for (@docker-root: the engine's
# DockerRootDir), the existing path df measures (df needs one: walk up, e.g. to the mount point).
disk_paths() {
    DF_RESOLVED=
    while IFS= read -r p; do
        [ -n "$p" ] || continue
        asked=$p
        if [ "$p" = @docker-root ]; then
            p=$(docker_root) || { echo "cannot ask the Docker engine for its DockerRootDir" >&2; continue; }
        fi
        q=$p
        while [ ! -e "$q" ] && [ "$q" != / ] && [ -n "$q" ]; do q=${q%/*}; done
        q=${q:-/}
        printf '%s\t%s\t%s\n' "$asked" "$p" "$q"
        DF_RESOLVED="$DF_RESOLVED$NL$q"
    done <<EOF
$DF_PATHS
EOF
}

df_paths() {
    set --
    while IFS= read -r p; do
        [ -n "$p" ] && set -- "$@" "$p"
    done <<EOF
$DF_RESOLVED
EOF
    [ $# -gt 0 ] || set -- /
    df -PB1 "$@"
}

images() {
    [ $# -gt 0 ] || return 0
    $T docker image inspect "$@"
}

read_file() {
    while IFS= read -r _l || [ -n "$_l" ]; do printf '%s\n' "$_l"; done <"$1"
}

# The engine's API paths the caller gave (api=..., already percent-encoded) are asked with ONE curl
# over the engine's unix socket -- the socket the docker CLI would use: DOCKER_HOST=unix://..., or
# the default one when neither DOCKER_HOST, DOCKER_CONTEXT nor a current context in the CLI's
# config says otherwise. Anything else (tcp://, ssh://, contexts, no curl): the docker CLI, 3 runs.
engine_socket() {
    case ${DOCKER_HOST-} in
        unix://*) SOCK=${DOCKER_HOST#unix://} ;;
        "")
            [ -z "${DOCKER_CONTEXT-}" ] || return 1
            _cfg=${DOCKER_CONFIG:-$HOME/.docker}/config.json
            if [ -e "$_cfg" ]; then
                while IFS= read -r _l || [ -n "$_l" ]; do
                    case $_l in *'"currentContext"'*) return 1 ;; esac
                done <"$_cfg"
            fi
            SOCK=/var/run/docker.sock
            ;;
        *) return 1 ;;
    esac
}

docker_api() {
    printf 'socket unix://%s\n' "$SOCK"
    # curl says only "Couldn't connect to server"; say why first, as the docker CLI would
    if [ ! -S "$SOCK" ]; then
        echo "no socket at $SOCK: is the Docker engine running?" >&2
    elif [ ! -w "$SOCK" ] || [ ! -r "$SOCK" ]; then
        echo "permission denied on $SOCK: is this user in the docker group?" >&2
    fi
    set -f
    _old=$IFS
    IFS=$NL
    _paths=$API_PATHS
    set --
    for p in $_paths; do [ -n "$p" ] && set -- "$@" "http://docker$p"; done
    IFS=$_old
    set +f
    # -D -: each answer's headers too (the engine's version is in every one: "Server: Docker/V (os)",
    # "Api-Version: V"), so no GET /version, the one call the engine answers slowly.
    curl -sS -g -D - --max-time 20 --unix-socket "$SOCK" -w "\n@@sparkctl $NONCE http %{http_code}\n" "$@"
}

# Round 1: every section, one per fact that sparkctl.facts.node_facts.NodeFacts declares (each field there names
# its section, the command below and its parser). Gathered and printed with one write, not fifty: each
# small write would be an SSH packet of its own, for sshd to seal and for the caller to open (one fork
# here saves more).
# ---- generated by `python -m sparkctl.facts.node_facts` from NodeFacts' declarations: edit those, not this
facts() {
    section host uname -nm
    section meminfo read_file /proc/meminfo
    section nofile ulimit -Hn
    section memlock ulimit -Hl
    section gpu $T nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,count --format=csv,noheader,nounits
    on banner && section gpu-banner $T nvidia-smi
    section gpu-apps gpu_apps
    section ip-addr ip -j addr show
    section infiniband ib_walk
    on listening && section listening ss -Hltn
    section machine-id read_file /etc/machine-id
    section kernel kernel_info
    section firmware fw_walk
    section fabric-record fabric_record
    section disk-paths disk_paths
    section df df_paths
    if on docker; then
        if [ -n "$API_PATHS" ] && command -v curl >/dev/null 2>&1 && engine_socket; then
            section docker-api docker_api
        else
            section docker-version $T docker version --format '{{json .}}'
            section docker-ps $T docker ps -a --no-trunc --filter "label=sparkctl.cluster=$CLUSTER" --format '{{json .}}'
            section docker-images images "$@"
        fi
    fi
    [ -n "$MODEL" ] && section model model_listing
}
# ---- end of the generated part
_facts=$(facts "$@")
printf '%s\n' "$_facts"

# Round 2, on the same channel (reach=PORT): say the facts are complete, then wait for one line from
# the caller -- every other rank's fabric address, known once all nodes' facts are in -- and run the
# reach test (reach_test, from probes/reach.sh) as one more section. This must stay the script's last
# line: the shell has then read the whole script, so the line read here can only be the caller's.
# No line (the caller went away: EOF) or an empty one: no test.
finish() {
    if [ -n "$REACH" ]; then
        printf '@@sparkctl %s ready\n' "$NONCE"
        if IFS= read -r _peers && [ -n "$_peers" ]; then
            set -f
            # shellcheck disable=SC2086 # one address per word
            section reach reach_test "$REACH" $_peers
        fi
    fi
    exit 0
}
finish
