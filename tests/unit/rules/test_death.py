"""Why a rank died, from its exit code, OOMKilled and the node's kernel lines: 137 with an OOM line is the
kernel's OOM killer; an Xid line is a GPU fault; 137 alone is a SIGKILL of unknown origin."""

from __future__ import annotations

from sparkctl.rules import death

OOM = "[Fri Dec  4 03:01:02 2026] Out of memory: Killed process 4242 (python3) total-vm:120000000kB"
XID = "[Fri Dec  4 03:01:02 2026] NVRM: Xid (PCI:0000:01:00): 79, pid=4242, GPU has fallen off the bus."


def test_exit_137_with_an_oom_line_is_the_oom_killer() -> None:
    assert death.why(137, False, [OOM]) == "the kernel's OOM killer ended it (the node's memory ran out)"
    assert "OOM killer" in (death.why(137, True, []) or "")


def test_xid_and_plain_sigkill_and_nothing() -> None:
    assert "Xid" in (death.why(1, False, [XID]) or "")
    assert "SIGKILL" in (death.why(137, False, ["usb 1-1: new device"]) or "")
    assert death.why(1, False, []) is None


def test_relevant_keeps_only_the_kernel_lines_that_matter() -> None:
    lines = ["usb 1-1: new device", OOM, "mlx5_core 0000:01:00.0: link down", XID]
    assert death.relevant(lines) == [OOM, lines[2], XID]
    assert death.relevant(lines, 1) == [XID]
