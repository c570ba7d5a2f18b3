# sparkctl setup probe: everything `sparkctl setup` reads of a node, in ONE round trip, read-only.
#
# Run on the node as:  sh -s -- NONCE FABRIC_DOC NEIGH < setup_facts.sh
#   NONCE       frames every section (facts/node_facts.parse_probe_sections' framing)
#   FABRIC_DOC  the fabric document's path (/etc/sparkctl/<cluster>/fabric.json)
#   NEIGH       yes: find each CX7 port's neighbours (ping ff02::1 on the port, then its neighbour table)
# Every value arrives as a positional argument and is only ever expanded in double quotes.
# Seams (tests and the lab): SPARKCTL_SYSFS_ROOT (the RDMA devices, default /sys/class/infiniband),
# SPARKCTL_SETUP_ROOT (a folder standing for / of every file setup reads or writes). POSIX sh only.

NONCE=$1
DOC=$2
NEIGH=$3
R=${SPARKCTL_SETUP_ROOT:-}

section() {
    _name=$1
    shift
    printf '@@sparkctl %s stderr %s\n' "$NONCE" "$_name" >&2
    printf '@@sparkctl %s begin %s\n' "$NONCE" "$_name"
    "$@" </dev/null
    _rc=$?
    printf '\n@@sparkctl %s end %s %d\n' "$NONCE" "$_name" "$_rc"
}

# hca NAME | netdev HCA DEV SPEED   (speed in Mb/s from sysfs, empty when the link is down)
ib_walk() {
    root=${SPARKCTL_SYSFS_ROOT:-/sys/class/infiniband}
    [ -d "$root" ] || return 0
    for h in "$root"/*; do
        [ -e "$h" ] || continue
        printf 'hca\t%s\n' "${h##*/}"
        for d in "$h"/device/net/*; do
            [ -e "$d" ] || continue
            sp=
            { read -r sp <"$d/speed"; } 2>/dev/null || { read -r sp <"/sys/class/net/${d##*/}/speed"; } 2>/dev/null
            printf 'netdev\t%s\t%s\t%s\n' "${h##*/}" "${d##*/}" "$sp"
        done
    done
}

# The interface that carries this SSH session: the route back to the client's address.
ssh_route() {
    set -- $SSH_CONNECTION
    printf 'client\t%s\n' "${1:-}"
    [ -n "${1:-}" ] && ip -j route get "$1"
    return 0
}

# The CX7 netdevs' neighbours after a bounded ping of every host on the port's link (all ports at once), and
# who answered that ping: a neighbour entry of a cable since moved stays in the table for minutes, so only the
# hosts that replied now count (when ping is missing, every entry does: no `@@replied` section). Two echo
# requests 0.2 s apart, at most 1 s: a link whose hosts answer is done in about 0.2 s, and a port without
# carrier (no cable, or down) is not pinged at all -- nothing could answer there.
neighbours() {
    [ "$NEIGH" = yes ] || return 0
    devs=$(ib_walk | awk -F '\t' '$1 == "netdev" { print $3 }')
    pings=$(mktemp -d) || return 0
    for d in $devs; do
        if ip -o link show dev "$d" 2>/dev/null | grep -q 'LOWER_UP'; then
            ping -6 -n -i 0.2 -c 2 -w 1 -I "$d" ff02::1 >"$pings/$d" 2>/dev/null &
        else
            : >"$pings/$d"
        fi
    done
    wait
    for d in $devs; do
        printf '@@dev\t%s\n' "$d"
        ip -j -6 neigh show dev "$d"
        printf '\n'
        if command -v ping >/dev/null 2>&1; then
            printf '@@replied\n'
            grep -o 'bytes from [^ ]*' "$pings/$d" | sort -u
        fi
    done
    rm -rf "$pings"
}

# earlyoom's program: on the PATH, or under the seam's root when there is one (R stands for / of every path).
has_earlyoom() {
    if [ -z "$R" ]; then
        command -v earlyoom
        return
    fi
    for _d in /usr/bin /usr/sbin /bin /sbin /usr/local/bin; do
        [ -x "$R$_d/earlyoom" ] && { echo "$_d/earlyoom"; return 0; }
    done
    return 1
}

# path, then its sha256 (or "absent" / "unreadable"): the files setup manages.
file_hash() {
    for f do
        if [ ! -e "$R$f" ]; then
            printf '%s\tabsent\n' "$f"
        elif h=$(sha256sum <"$R$f" 2>/dev/null) || h=$(sudo -n sha256sum -- "$R$f" 2>/dev/null); then
            printf '%s\t%s\n' "$f" "${h%% *}"
        else
            printf '%s\tunreadable\n' "$f"
        fi
    done
}

facts() {
    section user id -un
    section uid id -u
    section groups id -Gn
    section sudo sudo -n true
    section nofile sh -c 'ulimit -Hn'
    section memlock sh -c 'ulimit -Hl'
    section machine-id cat "$R/etc/machine-id"
    section ssh-route ssh_route
    section infiniband ib_walk
    section ip-addr ip -j addr show
    section neigh neighbours
    section earlyoom has_earlyoom
    section ctk sh -c 'command -v nvidia-ctk || command -v nvidia-container-runtime'
    section docker-group sh -c 'getent group docker'
    section files file_hash /etc/netplan/60-sparkctl-fabric.yaml /etc/sudoers.d/sparkctl \
        /etc/security/limits.d/60-sparkctl.conf /etc/default/earlyoom "$DOC"
    section fabric-doc cat "$R$DOC"
}
_facts=$(facts)
printf '%s\n' "$_facts"
