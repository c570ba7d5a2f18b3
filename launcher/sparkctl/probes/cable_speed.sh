# sparkctl setup --speed: one end of one cable's bandwidth test, over the fabric addresses setup set.
#
#   sh -c SCRIPT cable-speed serve   ADDR PEER PORT SECONDS    one iperf3 server on ADDR:PORT, for one test
#   sh -c SCRIPT cable-speed measure ADDR PEER PORT SECONDS    iperf3 from ADDR to PEER:PORT, 4 streams, JSON
# Every value is a positional argument. Exit 4: no iperf3 on the node. The client retries while the
# server is not up yet (it starts at the same time, on the other node), at most 10 s.
role=$1
addr=$2
peer=$3
port=$4
secs=$5
command -v iperf3 >/dev/null 2>&1 || {
    echo "iperf3 is not installed: install iperf3" >&2
    exit 4
}
case $role in
    serve) exec timeout "$((secs + 20))" iperf3 -s -1 -B "$addr" -p "$port" >/dev/null ;;
    measure)
        i=0
        while :; do
            out=$(timeout "$((secs + 20))" iperf3 -c "$peer" -B "$addr" -p "$port" -t "$secs" -P 4 -J 2>&1) && {
                printf '%s\n' "$out"
                exit 0
            }
            i=$((i + 1))
            if [ "$i" -ge 20 ]; then
                printf '%s\n' "$out"
                exit 1
            fi
            sleep 0.5
        done
        ;;
    *)
        echo "cable_speed: unknown role $role" >&2
        exit 2
        ;;
esac
