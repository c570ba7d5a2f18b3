#!/bin/sh
# The lab's stand-in for `netplan apply` (a lab host has no systemd-networkd): `netplan-apply ROOT`.
#
# The real `netplan generate` turns ROOT/etc/netplan/*.yaml into systemd-networkd files, and this applies
# what those files say, as networkd would on a real node, to the links they match in this host's network
# namespace: IPv4 addresses not listed are removed from that link, then each `Address=` added, `MTUBytes=`, the
# link up.
# Links no file matches are left as they are. The port's RoCE GID table then follows its addresses (roce_gids.py). Installed in each lab host's bin/ by `sparkctl lab up` and
# named by $SPARKCTL_NETPLAN_APPLY in the host's sshd environment (setup_apply.sh runs it with the root).
set -eu
R=$1
out=$(mktemp -d)
trap 'rm -rf -- "$out"' EXIT
mkdir -p "$out/etc/netplan"
for f in "$R"/etc/netplan/*.yaml; do
    [ -e "$f" ] && cp -p -- "$f" "$out/etc/netplan/"
done
PATH=$PATH:/usr/sbin:/sbin
netplan generate --root-dir "$out"
for f in "$out"/run/systemd/network/*.network; do
    [ -e "$f" ] || continue
    name=$(sed -n 's/^Name=//p' "$f" | head -n 1)
    [ -n "$name" ] || continue
    ip link show dev "$name" >/dev/null 2>&1 || { echo "netplan-apply: no link $name" >&2; exit 1; }
    mtu=$(sed -n 's/^MTUBytes=//p' "$f" | head -n 1)
    [ -z "$mtu" ] || ip link set dev "$name" mtu "$mtu"
    want=$(sed -n 's/^Address=//p' "$f")
    # the addresses no file lists go first: deleting a subnet's primary address takes the kernel's secondary
    # ones of that subnet with it (networkd sets promote_secondaries; deleting first needs no such setting)
    for have in $(ip -o -4 addr show dev "$name" scope global | awk '{print $4}'); do
        case " $(echo $want) " in
            *" $have "*) ;;
            *) ip addr del "$have" dev "$name" ;;
        esac
    done
    for a in $want; do
        ip addr replace "$a" dev "$name"
    done
    ip link set dev "$name" up
    # the kernel adds and drops a port's RoCE GIDs with its addresses: so does the lab's sysfs seam
    python3 "$(dirname "$0")/roce_gids.py" "$name"
done
