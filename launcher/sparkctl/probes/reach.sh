# sparkctl reach test: can this node open a path to each peer's fabric address?
#
# A library: it defines reach_test and runs nothing. `check` sends it ahead of node_facts.sh, which
# runs it as its last section once the client has sent every peer's address (one probe per node
# does both rounds). By hand:   sh -c '. ./reach.sh; reach_test PORT IP...'
# Prints one line per peer: "ok IP" or "fail IP REASON".
#
# The test is a TCP connect to PORT (the master port: the one the ranks must reach): an answer of
# any kind -- accepted, or "connection refused" (a RST from the peer's kernel) -- proves the path.
# 1. ONE bash tries the peers one after another, with no fork at all, under a 1 s budget: on a
#    healthy fabric each connect is answered within a round trip, so a 16-node check costs each node
#    one process here, not 15 (every node of a check runs this at once; on the lab, all on one
#    machine's CPUs). Its stderr is merged into its stdout, so a connect's error lands right after
#    that peer's "try" line and is read back with the shell's own patterns.
# 2. The peers it did not settle (a connect that hangs: packets dropped somewhere) are tried at once,
#    one forked subshell each, under 3 s.
# 3. For a peer TCP could not reach, ping (where it exists) tells "no path at all" from "the path
#    works but something drops TCP to this port" (a firewall: the rendezvous would fail the same way).
reach_test() {
    port=$1
    shift
    nl='
'
    if ! command -v bash >/dev/null 2>&1; then
        for ip do printf 'fail %s no bash on this node for the TCP test\n' "$ip"; done
        return 0
    fi
    T1=
    T3=
    if command -v timeout >/dev/null 2>&1; then
        T1="timeout -k 1 1"
        T3="timeout -k 1 3"
    fi

    # shellcheck disable=SC2016 # the inner script is bash's
    seq=$($T1 bash -c '
        port=$1
        shift
        for ip do
            printf "try %s\n" "$ip"
            if { exec 3<>"/dev/tcp/$ip/$port"; }; then
                exec 3>&-
                printf "ok %s\n" "$ip"
            fi
        done 2>&1' reach "$port" "$@" 2>/dev/null)

    # Read it line by line (a field split, no process): "try IP", then "ok IP" or the connect's error.
    # (No ${seq#*"try $ip"} per peer: dash strips such patterns in time quadratic in the text's length.)
    settled=" "
    cur=
    set -f
    _ifs=$IFS
    IFS=$nl
    for line in $seq; do
        case $line in
            "try "*) cur=${line#try } ;;
            "ok "*)
                printf '%s\n' "$line"
                settled="$settled${line#ok } "
                cur=
                ;;
            *)
                [ -n "$cur" ] || continue
                case $line in
                    *refused*) printf 'ok %s\n' "$cur" ;;
                    *) printf 'fail %s %.160s\n' "$cur" "${line#reach: connect: }" ;;
                esac
                settled="$settled$cur "
                cur=
                ;;
        esac
    done
    IFS=$_ifs
    set +f
    rest=
    for ip do
        case $settled in
            *" $ip "*) ;;
            *) rest="$rest $ip" ;; # the budget ran out during its connect, or before it
        esac
    done
    [ -n "$rest" ] || return 0

    # The slow ones, all at once: one forked subshell per peer; the connect's error goes to a file and is
    # read back with builtins.
    # Its scratch folder is its own: mktemp -d's, else one that mkdir makes new (it fails on any existing
    # name, a planted link included), never `mkdir -p` on a guessable name in a shared /tmp.
    tmp=$(mktemp -d 2>/dev/null) || { tmp="${TMPDIR:-/tmp}/sparkctl-reach.$$"; mkdir -m 700 -- "$tmp" 2>/dev/null; } || {
        for ip in $rest; do
            printf 'fail %s cannot make a private temporary folder for the TCP test (mktemp -d failed)\n' "$ip"
        done
        return 0
    }
    # shellcheck disable=SC2016,SC2086 # the inner script is bash's; $rest is a list of addresses
    tcp=$($T3 bash -c '
        port=$1
        tmp=$2
        shift 2
        for ip do
            (
                if { exec 3<>"/dev/tcp/$ip/$port"; } 2>"$tmp/$ip"; then
                    printf "ok %s\n" "$ip"
                else
                    IFS= read -r out <"$tmp/$ip"
                    case "$out" in
                        *refused*) printf "ok %s\n" "$ip" ;;
                        *) out=${out#reach: }; out=${out#connect: }; printf "fail %s %.160s\n" "$ip" "$out" ;;
                    esac
                fi
            ) &
        done
        wait' reach "$port" "$tmp" $rest 2>/dev/null)
    rm -rf "$tmp"

    answered=
    if command -v ping >/dev/null 2>&1; then
        # $( ) returns once every background ping has closed its stdout
        # shellcheck disable=SC2086
        answered=$(for ip in $rest; do (ping -n -c 1 -W 2 "$ip" >/dev/null 2>&1 && echo "$ip") & done; wait)
        answered=" $(echo $answered) "
    fi
    for ip in $rest; do
        case "$nl$tcp$nl" in
            *"${nl}ok $ip$nl"*)
                printf 'ok %s\n' "$ip"
                continue
                ;;
            *"${nl}fail $ip "*)
                why=${tcp#*"fail $ip "}
                why=${why%%"$nl"*}
                ;;
            *) why="no answer to a TCP connect to port $port within 3s" ;;
        esac
        case $answered in
            *" $ip "*) printf 'fail %s answers ping but not TCP to port %s (%s): a firewall?\n' "$ip" "$port" "$why" ;;
            *) printf 'fail %s %s\n' "$ip" "$why" ;;
        esac
    done
}
