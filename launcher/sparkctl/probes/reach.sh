# sparkctl reach probe: can this node open a path to each peer's fabric address?
#
# Run on the node as:   sh -s -- PORT IP... < reach.sh
# Prints one line per peer: "ok IP" or "fail IP REASON". All peers are tried at once.
# ping (ICMP) first where it exists; else, or when ICMP is filtered, a TCP connect to PORT: an
# answer of any kind -- accepted or "connection refused" (a RST) -- proves the path works.
port=$1
shift
have_ping=
command -v ping >/dev/null 2>&1 && have_ping=1
have_bash=
command -v bash >/dev/null 2>&1 && have_bash=1
for ip do
    (
        if [ -n "$have_ping" ] && ping -n -c 1 -W 2 "$ip" >/dev/null 2>&1; then
            printf 'ok %s\n' "$ip"
            exit 0
        fi
        if [ -z "$have_bash" ]; then
            printf 'fail %s no ping answer, and no bash for a TCP test\n' "$ip"
            exit 0
        fi
        out=$(timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$ip" "$port" 2>&1)
        rc=$?
        case "$rc:$out" in
            0:* | *refused*) printf 'ok %s\n' "$ip" ;;
            124:*) printf 'fail %s no answer within 3s\n' "$ip" ;;
            *) printf 'fail %s %s\n' "$ip" "$(printf '%s' "$out" | tr '\n' ' ' | sed 's/^bash: //' | cut -c1-160)" ;;
        esac
    ) &
done
wait
