# sparkctl reach probe: can this node open a path to each peer's fabric address?
#
# Run on the node as:   sh -s -- PORT IP... < reach.sh
# Prints one line per peer: "ok IP" or "fail IP REASON". All peers are tried at once.
# ping (ICMP) first where it exists; for the peers it did not answer (or with no ping at all), a TCP
# connect to PORT: an answer of any kind -- accepted or "connection refused" (a RST) -- proves the
# path works. The TCP tests run in ONE bash (one forked subshell per peer, no exec) under one 3 s
# `timeout`, so a 16-node check does not start 16 x 15 x 2 processes on the cluster.
port=$1
shift

answered=
if command -v ping >/dev/null 2>&1; then
    # $( ) returns once every background ping has closed its stdout
    answered=$(for ip do (ping -n -c 1 -W 2 "$ip" >/dev/null 2>&1 && echo "$ip") & done; wait)
fi
answered=" $(echo $answered) "
rest=
for ip do
    case $answered in
        *" $ip "*) printf 'ok %s\n' "$ip" ;;
        *) rest="$rest $ip" ;;
    esac
done
[ -n "$rest" ] || exit 0

if ! command -v bash >/dev/null 2>&1; then
    for ip in $rest; do printf 'fail %s no ping answer, and no bash for a TCP test\n' "$ip"; done
    exit 0
fi
T=
command -v timeout >/dev/null 2>&1 && T="timeout -k 1 3"
# shellcheck disable=SC2016,SC2086 # the inner script is bash's; $rest is a list of addresses
# One fork per peer: the connect's error goes to a file and is read back with builtins (no $(...)).
tmp=$(mktemp -d 2>/dev/null || echo "/tmp/sparkctl-reach.$$")
mkdir -p "$tmp"
tcp=$($T bash -c '
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
                    *) out=${out#bash: }; printf "fail %s %.160s\n" "$ip" "$out" ;;
                esac
            fi
        ) &
    done
    wait' reach "$port" "$tmp" $rest 2>/dev/null)
rm -rf "$tmp"
# Match each peer's line with the shell's own patterns (no grep per peer).
nl='
'
for ip in $rest; do
    case "$nl$tcp$nl" in
        *"${nl}ok $ip$nl"*) printf 'ok %s\n' "$ip" ;;
        *"${nl}fail $ip "*)
            why=${tcp#*"fail $ip "}
            printf 'fail %s %s\n' "$ip" "${why%%"$nl"*}"
            ;;
        *) printf 'fail %s no answer within 3s\n' "$ip" ;;
    esac
done
