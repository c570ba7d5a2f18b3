# sparkctl setup --speed: one end of one cable's bandwidth test, over the fabric addresses setup set.
#
#   sh -c SCRIPT cable-speed serve   ADDR PEER PORT SECONDS    one iperf3 server on ADDR:PORT, for one test
#   sh -c SCRIPT cable-speed measure ADDR PEER PORT SECONDS    iperf3 from ADDR to PEER:PORT, 4 streams, JSON
# Every value is a positional argument. Exit 4: no iperf3 on the node. The client retries while the
# server is not up yet (it starts at the same time, on the other node), at most 30 s (a loaded node is slow to start it).
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
    serve)
        # one test at a time (-1), started again after a test that did not complete (a client attempt that
        # connected and failed ends a one-off server), until one completes or the time is up
        end=$(($(date +%s) + secs + 40))
        while [ "$(date +%s)" -lt "$end" ]; do
            timeout "$((secs + 20))" iperf3 -s -1 -B "$addr" -p "$port" >/dev/null 2>&1 && exit 0
            sleep 0.2
        done
        exit 1
        ;;
    measure)
        i=0
        while :; do
            # iperf3 -J can exit 0 with {"error": "unable to connect ..."}: that is a try to repeat too
            if out=$(timeout "$((secs + 20))" iperf3 -c "$peer" -B "$addr" -p "$port" -t "$secs" -P 4 -J 2>&1); then
                case $out in
                    *'"error":'*) ;;
                    *)
                        printf '%s\n' "$out"
                        exit 0
                        ;;
                esac
            fi
            i=$((i + 1))
            if [ "$i" -ge 60 ]; then
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
