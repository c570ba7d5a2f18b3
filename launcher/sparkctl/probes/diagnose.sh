# sparkctl diagnose probe: what a bug report needs from one node, in ONE round trip, read-only.
#
# Run on the node as:  sh -s -- NONCE CLUSTER TAIL KLINES [IMAGE...] < (kernel_lines.sh, diagnose.sh)
# (probes/kernel_lines.sh is sent ahead of this script: it defines kernel_lines)
#   CLUSTER  the sparkctl.cluster label of this cluster's containers
#   TAIL     log lines per container;  KLINES  kernel lines (OOM, Xid, NVRM, mlx5) at most
#   IMAGE    images whose inspect (labels: the versions `build` recorded) is wanted
# Prints one section per file, framed as node_facts.sh frames them (sparkctl.facts.node_facts.
# parse_probe_sections): stdout "@@sparkctl NONCE begin NAME" ... "@@sparkctl NONCE end NAME RC", stderr
# "@@sparkctl NONCE stderr NAME". Every value is a positional argument, expanded only in double quotes.
# Each command runs under a timeout (when the node has timeout(1)). Seams: $SPARKCTL_SYSFS_ROOT (the
# RDMA devices), $SPARKCTL_KERNEL_SEAM (files standing in for the kernel's: release, cmdline, kmsg).
# POSIX sh only.

NONCE=$1
CLUSTER=$2
TAIL=$3
KLINES=$4
shift 4
if command -v timeout >/dev/null 2>&1; then T="timeout -k 2 15"; else T=; fi

section() {
    _name=$1
    shift
    printf '@@sparkctl %s stderr %s\n' "$NONCE" "$_name" >&2
    printf '@@sparkctl %s begin %s\n' "$NONCE" "$_name"
    "$@" </dev/null
    _rc=$?
    printf '\n@@sparkctl %s end %s %d\n' "$NONCE" "$_name" "$_rc"
}

first() { # the first of the files given that can be read, printed
    for f do
        if [ -r "$f" ]; then cat "$f"; return; fi
    done
    return 1
}

seam() { # $SPARKCTL_KERNEL_SEAM/NAME when a lab host has it, else the real file
    if [ -n "${SPARKCTL_KERNEL_SEAM:-}" ] && [ -r "$SPARKCTL_KERNEL_SEAM/$1" ]; then
        printf '%s\n' "$SPARKCTL_KERNEL_SEAM/$1"
    else
        printf '%s\n' "$2"
    fi
}

kernel() {
    printf 'release: %s\n' "$(cat "$(seam release /proc/sys/kernel/osrelease)")"
    printf 'cmdline: %s\n' "$(cat "$(seam cmdline /proc/cmdline)" 2>/dev/null)"
    uname -a
}

# The fabric ports: every RDMA device's netdevs, with MTU, speed, carrier, addresses and GIDs.
ib_root() { printf '%s\n' "${SPARKCTL_SYSFS_ROOT:-/sys/class/infiniband}"; }
fabric_ports() {
    for d in "$(ib_root)"/*/device/net/*; do
        [ -e "$d" ] && printf '%s\n' "${d##*/}"
    done | sort -u
}

fabric() {
    root=$(ib_root)
    for h in "$root"/*; do
        [ -e "$h" ] || continue
        printf 'device %s fw %s\n' "${h##*/}" "$(cat "$h/fw_ver" 2>/dev/null)"
        for p in "$h"/ports/*; do
            [ -d "$p" ] || continue
            printf '  port %s state %s link_layer %s\n' "${p##*/}" "$(cat "$p/state" 2>/dev/null)" \
                "$(cat "$p/link_layer" 2>/dev/null)"
            for g in "$p"/gids/*; do
                gid=$(cat "$g" 2>/dev/null)
                case $gid in '' | 0000:0000:0000:0000:0000:0000:0000:0000) continue ;; esac
                i=${g##*/}
                printf '    gid %s %s %s %s\n' "$i" "$gid" "$(cat "$p/gid_attrs/types/$i" 2>/dev/null)" \
                    "$(cat "$p/gid_attrs/ndevs/$i" 2>/dev/null)"
            done
        done
    done
    for n in $(fabric_ports); do
        s=/sys/class/net/$n
        printf 'netdev %s mtu %s speed %s carrier %s operstate %s\n' "$n" "$(cat "$s/mtu" 2>/dev/null)" \
            "$(cat "$s/speed" 2>/dev/null)" "$(cat "$s/carrier" 2>/dev/null)" "$(cat "$s/operstate" 2>/dev/null)"
        ip -d addr show dev "$n" 2>&1
    done
}

ethtool_i() {
    command -v ethtool >/dev/null 2>&1 || { echo "ethtool is not installed" >&2; return 127; }
    for n in $(fabric_ports); do
        printf '== ethtool -i %s\n' "$n"
        # shellcheck disable=SC2086
        $T ethtool -i "$n" 2>&1
    done
}

toolkit() {
    if command -v nvidia-ctk >/dev/null 2>&1; then
        # shellcheck disable=SC2086
        $T nvidia-ctk --version
    elif command -v nvidia-container-cli >/dev/null 2>&1; then
        # shellcheck disable=SC2086
        $T nvidia-container-cli --version
    else
        echo "nvidia-container-toolkit: not installed (no nvidia-ctk, no nvidia-container-cli)" >&2
        return 127
    fi
}

containers() {
    # shellcheck disable=SC2086
    $T docker ps -a -q --no-trunc --filter "label=sparkctl.cluster=$CLUSTER"
}

inspect() {
    _ids=$(containers) || return 1
    [ -n "$_ids" ] || { echo '[]'; return 0; }
    # shellcheck disable=SC2086
    $T docker inspect $_ids
}

logs() {
    _ids=$(containers) || return 1
    for c in $_ids; do
        printf '@@container %s\n' "$c"
        # shellcheck disable=SC2086
        $T docker logs --timestamps --tail "$TAIL" "$c" 2>&1
    done
}

images() {
    [ $# -gt 0 ] || return 0
    # shellcheck disable=SC2086
    $T docker image inspect "$@"
}

section kernel kernel
section os-release first /etc/os-release /usr/lib/os-release
section nvidia-smi $T nvidia-smi
section gpu-apps $T nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
section meminfo cat /proc/meminfo
section fabric fabric
section ethtool ethtool_i
section fabric-document first "${SPARKCTL_SETUP_ROOT:-}/etc/sparkctl/$CLUSTER/fabric.json"
section kernel-lines kernel_lines "$KLINES"
section docker-version $T docker version
section container-toolkit toolkit
section docker-inspect inspect
section docker-logs logs
section image-inspect images "$@"
exit 0
