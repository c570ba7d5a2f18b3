# sparkctl setup: apply one node's planned changes, as root (or through `sudo -n`).
#
#   sh -c SCRIPT sparkctl-setup CLUSTER TRY_S RECORD...
#   RECORD: file PATH MODE CHECK CONTENT     (CHECK: netplan | sudoers | none)
#           cmd ACTION ARG                   (ACTION: docker-group | install-earlyoom | restart-earlyoom | netplan-apply)
# Every value is a positional argument, only ever expanded in double quotes.
#
# 1. Every file is written to a temp file in its own folder and validated by the real tool (`visudo -cf`,
#    `netplan generate --root-dir` on a copy of the node's netplan folder with the candidate in place);
#    one refusal removes every temp file and changes nothing (exit 3).
# 2. The files other than netplan's are renamed into place; then the commands run.
# 3. Netplan last, with try semantics: the old file is kept aside, a timer (its own session, so it outlives
#    this connection) restores it and applies again after TRY_S seconds unless `confirm` (below) removed
#    claimed the pending mark first; then `netplan apply`. The caller confirms from a new SSH connection.
#    Prints "@@sparkctl-netplan pending" when it waits for that confirmation.
# Seams (tests and the lab): SPARKCTL_SETUP_ROOT stands for / of every path; there a command runs only as
# $SPARKCTL_SETUP_ROOT/sbin/NAME when that exists (else it is recorded in $SPARKCTL_SETUP_ROOT/commands.log),
# and SPARKCTL_NETPLAN_APPLY, when set, is run with the root instead of `netplan apply`.

set -u
CLUSTER=$1
TRY=$2
shift 2
R=${SPARKCTL_SETUP_ROOT:-}
STATE="$R/etc/sparkctl/$CLUSTER"
NETPLAN_APPLY=${SPARKCTL_NETPLAN_APPLY:-}
NL='
'
TMPS=
PLACE=
CMDS=
NETPLAN_TMP=
NETPLAN_PATH=
APPLY=no
umask 022
PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin # netplan, visudo, usermod live there; a login without them still finds them
export PATH

MADE=  # folders this run made, deepest first: removed again (when empty) if it changes nothing
DONE=no
cleanup() {
    printf '%s\n' "$TMPS" | while IFS= read -r t; do [ -n "$t" ] && rm -rf -- "$t"; done
    [ "$DONE" = yes ] || printf '%s\n' "$MADE" | while IFS= read -r d; do [ -n "$d" ] && rmdir -- "$d" 2>/dev/null; done
}
trap cleanup EXIT
fail() {
    echo "@@sparkctl-setup-error $*" >&2
    exit 3
}

run() {
    if [ -z "$R" ]; then
        "$@"
    elif [ -x "$R/sbin/$1" ]; then
        _c=$1
        shift
        "$R/sbin/$_c" "$@"
    else
        printf '%s\n' "$*" >>"$R/commands.log"
    fi
}

netplan_check() { # TMP PATH: the node's netplan folder with the candidate in place, generated elsewhere
    command -v netplan >/dev/null 2>&1 || fail "netplan is not installed: install netplan.io"
    _t=$(mktemp -d) || fail "cannot make a temp folder"
    TMPS="$TMPS$NL$_t"
    mkdir -p "$_t/etc/netplan"
    for _f in "$R"/etc/netplan/*.yaml; do
        [ -e "$_f" ] && [ "$_f" != "$R$2" ] && cp -p -- "$_f" "$_t/etc/netplan/"
    done
    cp -- "$1" "$_t$2" && chmod 600 "$_t$2" || fail "cannot copy the candidate netplan file"
    _out=$(netplan generate --root-dir "$_t" 2>&1) || fail "netplan generate refused $2: $_out"
    rm -rf -- "$_t"
}

while [ $# -gt 0 ]; do
    case $1 in
        file)
            [ $# -ge 5 ] || fail "setup_apply: a file record needs 4 values"
            _path=$2 _mode=$3 _check=$4 _content=$5
            shift 5
            _dir=$(dirname -- "$R$_path")
            _d=$_dir
            while [ ! -d "$_d" ]; do MADE="$MADE$NL$_d" _d=$(dirname -- "$_d"); done
            mkdir -p -- "$_dir" || fail "cannot make $_dir"
            _tmp=$(mktemp "$_dir/.sparkctl.XXXXXX") || fail "cannot write in $_dir"
            TMPS="$TMPS$NL$_tmp"
            { printf '%s' "$_content" >"$_tmp" && chmod "$_mode" "$_tmp"; } || fail "cannot write $_tmp"
            case $_check in
                sudoers)
                    command -v visudo >/dev/null 2>&1 || fail "visudo is not installed: install sudo"
                    _out=$(visudo -cf "$_tmp" 2>&1) || fail "visudo -cf refused $_path: $_out"
                    ;;
                netplan)
                    netplan_check "$_tmp" "$_path"
                    NETPLAN_TMP=$_tmp NETPLAN_PATH=$_path APPLY=yes
                    continue
                    ;;
                none) ;;
                *) fail "setup_apply: unknown check $_check" ;;
            esac
            PLACE="$PLACE$NL$_tmp	$R$_path"
            ;;
        cmd)
            [ $# -ge 3 ] || fail "setup_apply: a cmd record needs 2 values"
            case $2 in
                netplan-apply) APPLY=yes ;;
                docker-group | install-earlyoom | restart-earlyoom) CMDS="$CMDS$NL$2	$3" ;;
                *) fail "setup_apply: unknown action $2" ;;
            esac
            shift 3
            ;;
        *) fail "setup_apply: unknown record $1" ;;
    esac
done

# 2. the files, then the commands
DONE=yes
printf '%s\n' "$PLACE" | while IFS='	' read -r _tmp _dst; do
    [ -n "$_tmp" ] || continue
    mv -f -- "$_tmp" "$_dst" || exit 3
    echo "@@sparkctl-wrote ${_dst#"$R"}"
done || fail "a file could not be renamed into place"
printf '%s\n' "$CMDS" | while IFS='	' read -r _a _arg; do
    case $_a in
        docker-group) run usermod -aG docker "$_arg" || exit 3 ;;
        install-earlyoom) DEBIAN_FRONTEND=noninteractive run apt-get install -y -o Dpkg::Options::=--force-confold earlyoom || exit 3 ;;
        restart-earlyoom) run systemctl restart earlyoom || exit 3 ;;
        *) continue ;;
    esac
    echo "@@sparkctl-ran $_a"
done || fail "a command failed (above)"

# 3. netplan, with try semantics
[ "$APPLY" = yes ] || exit 0
[ -n "$NETPLAN_PATH" ] || NETPLAN_PATH=/etc/netplan/60-sparkctl-fabric.yaml
mkdir -p -- "$STATE" || fail "cannot make $STATE"
pending="$STATE/netplan.pending"
applying="$STATE/netplan.applying"
prev="$STATE/netplan.prev"
rm -f -- "$prev" "$STATE/netplan.reverted"
[ -e "$R$NETPLAN_PATH" ] && { cp -p -- "$R$NETPLAN_PATH" "$prev" || fail "cannot keep the old netplan file aside"; }
date +%s >"$pending" && date +%s >"$applying" || fail "cannot write in $STATE"
command -v setsid >/dev/null 2>&1 && SETSID=setsid || SETSID=
# The timer: TRY_S after the start, and after the apply ended (at most TRY_S more), it claims the try by
# renaming the pending mark (the confirmation claims it the same way: one of the two wins), restores the old
# file, applies again and leaves netplan.reverted. It looks at the mark every second: once a confirmation
# claimed it, the timer ends then, not TRY_S later.
# shellcheck disable=SC2016 # the timer's own script: its values are its positional arguments
$SETSID nohup sh -c 'i=0
while [ -e "$2" ] && [ "$i" -lt "$1" ]; do sleep 1; i=$((i + 1)); done
[ -e "$2" ] || exit 0
i=0
while [ -e "$7" ] && [ "$i" -lt "$1" ]; do sleep 1; i=$((i + 1)); done
mv -- "$2" "$2.reverting" 2>/dev/null || exit 0
if [ -e "$3" ]; then mv -f -- "$3" "$4"; else rm -f -- "$4"; fi
if [ -n "$5" ]; then "$5" "$6"; else netplan apply; fi
rm -f -- "$2.reverting"; date +%s >"$8"' sparkctl-netplan-revert \
    "$TRY" "$pending" "$prev" "$R$NETPLAN_PATH" "$NETPLAN_APPLY" "$R" "$applying" "$STATE/netplan.reverted" \
    </dev/null >/dev/null 2>&1 &
if [ -n "$NETPLAN_TMP" ]; then
    mv -f -- "$NETPLAN_TMP" "$R$NETPLAN_PATH" || { rm -f -- "$applying"; fail "cannot rename the netplan file into place"; }
    echo "@@sparkctl-wrote $NETPLAN_PATH"
fi
if [ -n "$NETPLAN_APPLY" ]; then
    "$NETPLAN_APPLY" "$R" || { rm -f -- "$applying"; fail "the netplan apply seam failed (the old file comes back within $TRY s)"; }
else
    netplan apply || { rm -f -- "$applying"; fail "netplan apply failed (the old file comes back within $TRY s)"; }
fi
rm -f -- "$applying"
echo "@@sparkctl-netplan pending"
