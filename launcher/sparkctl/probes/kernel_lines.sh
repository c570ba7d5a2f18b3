# kernel_lines N: the kernel's lines about OOM kills, Xid errors, the NVIDIA driver (NVRM) and the CX7
# driver (mlx5), the last N, from dmesg (or journalctl -k when dmesg is restricted). A lab host's
# $SPARKCTL_KERNEL_SEAM/kmsg stands in for the kernel's ring buffer. Defines the function only: the
# caller sends a fixed call line after it (the value, N, arrives as a positional argument). POSIX sh.
kernel_lines() {
    _n=$1
    _re='out of memory|oom[-_ ]kill|oom_reaper|xid|nvrm|mlx5'
    if [ -n "${SPARKCTL_KERNEL_SEAM:-}" ] && [ -r "$SPARKCTL_KERNEL_SEAM/kmsg" ]; then
        grep -aiE "$_re" "$SPARKCTL_KERNEL_SEAM/kmsg" | tail -n "$_n"
        return 0
    fi
    if command -v timeout >/dev/null 2>&1; then _t="timeout -k 2 10"; else _t=; fi
    # shellcheck disable=SC2086 # $_t is a command prefix or nothing
    if _o=$($_t dmesg -T 2>/dev/null) && [ -n "$_o" ]; then :
    elif _o=$($_t journalctl -k -b --no-pager -o short-iso 2>/dev/null); then :
    else
        echo "neither dmesg nor journalctl -k could be read (kernel.dmesg_restrict? a user in adm or systemd-journal can)" >&2
        return 1
    fi
    printf '%s\n' "$_o" | grep -aiE "$_re" | tail -n "$_n"
    return 0
}
