# sparkctl node facts probe: every read-only fact `check` needs, in ONE round trip.
#
# Run on the node as:   sh -s -- NONCE [model=DIR] [cluster=NAME] [df=PATH]... [image=REF]... < node_facts.sh
# Prints one section per fact, framed by lines that carry the caller's random NONCE (so nothing a
# node prints -- a file name, a container label -- can forge a section boundary):
#   @@sparkctl NONCE begin NAME      then the command's stdout
#   @@sparkctl NONCE stderr NAME     then the first lines of its stderr
#   @@sparkctl NONCE end NAME RC
# Every value arrives as a positional argument (quoted by the caller) and is only ever expanded in
# double quotes: a model path like '$(touch x)' is a path, never a command.
# Hardware seams: sysfs from ${SPARKCTL_SYSFS_ROOT:-/sys/class/infiniband}; nvidia-smi and docker
# from PATH; docker talks to the session's DOCKER_HOST. POSIX sh only (dash on Debian/Ubuntu).

NONCE=$1
shift
MODEL=
CLUSTER=sparkctl
DF_PATHS=
# Split key=value arguments; the image references are rebuilt into "$@" (sh has no arrays).
for a do
    shift
    case $a in
        model=*) MODEL=${a#model=} ;;
        cluster=*) CLUSTER=${a#cluster=} ;;
        df=*) DF_PATHS="$DF_PATHS
${a#df=}" ;;
        image=*) set -- "$@" "${a#image=}" ;;
    esac
done

ERR=$(mktemp 2>/dev/null || echo "/tmp/sparkctl-probe.$$")
trap 'rm -f "$ERR"' EXIT
# A wedged nvidia-smi or docker engine must not hang the whole check.
if command -v timeout >/dev/null 2>&1; then T="timeout -k 2 20"; else T=; fi

section() {
    _name=$1
    shift
    printf '@@sparkctl %s begin %s\n' "$NONCE" "$_name"
    "$@" 2>"$ERR"
    _rc=$?
    printf '\n@@sparkctl %s stderr %s\n' "$NONCE" "$_name"
    _n=0
    while [ $_n -lt 20 ] && IFS= read -r _line; do
        printf '%s\n' "$_line"
        _n=$((_n + 1))
    done <"$ERR"
    printf '@@sparkctl %s end %s %d\n' "$NONCE" "$_name" "$_rc"
}

# One record per line, tab-separated (parsed by sparkctl.facts.parse_infiniband).
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

model_listing() {
    if [ ! -d "$MODEL" ]; then
        echo missing
        return 0
    fi
    # Top level (the shards, config.json) and one level down (serving/, lm_head-6bit/).
    find "$MODEL/" -maxdepth 2 -type f -printf '%s\t%P\n'
}

df_paths() {
    set --
    while IFS= read -r p; do
        [ -n "$p" ] || continue
        # df needs an existing path: walk up to the nearest one (images dir not created yet).
        while [ ! -e "$p" ] && [ "$p" != / ] && [ -n "$p" ]; do p=${p%/*}; done
        set -- "$@" "${p:-/}"
    done <<EOF
$DF_PATHS
EOF
    [ $# -gt 0 ] || set -- /
    df -PB1 "$@"
}

images() {
    [ $# -gt 0 ] || return 0
    $T docker image inspect "$@"
}

section host uname -nm
section meminfo cat /proc/meminfo
section nofile ulimit -Hn
section memlock ulimit -Hl
section gpu $T nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,count --format=csv,noheader,nounits
section gpu-banner $T nvidia-smi
section ip-addr ip -j addr show
section infiniband ib_walk
section listening ss -Hltn
section df df_paths
section docker-version $T docker version --format '{{json .}}'
section docker-ps $T docker ps -a --no-trunc --filter "label=sparkctl.cluster=$CLUSTER" --format '{{json .}}'
section docker-images images "$@"
[ -n "$MODEL" ] && section model model_listing
exit 0
