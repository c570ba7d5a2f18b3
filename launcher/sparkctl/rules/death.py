"""Why a rank died, in words: its exit code, Docker's OOMKilled flag and the node's kernel lines.

"exited 137" says only that SIGKILL ended it; the kernel's own lines about its OOM killer (or an Xid, the
GPU driver's error report) around the time of death say who sent it. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

OOM_LINE = re.compile(r"(?i)out of memory|oom[-_ ]kill|oom_reaper|memory cgroup out of memory")
XID_LINE = re.compile(r"(?i)\bNVRM: Xid\b|\bXid \(")
KERNEL_LINE = re.compile(r"(?i)out of memory|oom[-_ ]kill|oom_reaper|\bxid\b|nvrm|mlx5")


def relevant(lines: Sequence[str], limit: int = 20) -> list[str]:
    """The kernel lines about OOM kills, Xid errors, NVRM and mlx5, the last `limit`."""
    return [ln for ln in lines if KERNEL_LINE.search(ln)][-limit:]


def why(exit_code: int | None, oom_killed: bool | None, kernel_lines: Sequence[str]) -> str | None:
    """The cause a rank's death points to, or None when nothing says more than its exit code."""
    oom = [ln for ln in kernel_lines if OOM_LINE.search(ln)]
    xid = [ln for ln in kernel_lines if XID_LINE.search(ln)]
    if oom_killed or (exit_code == 137 and oom):
        where = "the container's memory limit" if oom_killed and not oom else "the node's memory"
        return f"the kernel's OOM killer ended it ({where} ran out)"
    if xid:
        return "the GPU driver reported an Xid error (a GPU fault) around its death"
    if exit_code == 137:
        return "SIGKILL ended it (no OOM line in the kernel's log: `docker kill`, a supervisor, or a timeout)"
    return None
