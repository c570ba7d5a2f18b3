"""What `docker inspect` (its whole JSON) and the diagnose probe's log section say about the ranks.

Pure parsers of untrusted node output: each returns its fact or raises ParseError.
"""

from __future__ import annotations

import re
from typing import Any

from .parsing import ParseError, guard, parse_json

_CONTAINER_MARK = re.compile(r"@@container ([0-9a-f]{12,64})")


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


@guard
def rank_summaries(text: str) -> list[dict[str, Any]]:
    """`docker inspect ID...` -> per container: name, rank (the sparkctl.rank label), image, state,
    exit code, OOMKilled, started/finished times, restart count. Nothing of Config.Env."""
    data = parse_json(text) if text.strip() else []
    if not isinstance(data, list):
        raise ParseError("docker inspect did not print a list")
    out = []
    for item in data:
        if not isinstance(item, dict):
            raise ParseError("docker inspect entry is not an object")
        state = _dict(item.get("State"))
        labels = _dict(_dict(item.get("Config")).get("Labels"))
        out.append({
            "id": str(item.get("Id", ""))[:64],
            "name": str(item.get("Name", "")).lstrip("/")[:255],
            "rank": labels.get("sparkctl.rank"),
            "image": str(_dict(item.get("Config")).get("Image", ""))[:255],
            "status": state.get("Status"),
            "exit_code": state.get("ExitCode"),
            "oom_killed": state.get("OOMKilled"),
            "error": str(state.get("Error", ""))[:500],
            "started_at": state.get("StartedAt"),
            "finished_at": state.get("FinishedAt"),
            "restart_count": item.get("RestartCount"),
        })
    return out


def split_logs(text: str) -> dict[str, str]:
    """The probe's docker-logs section ("@@container ID" then that container's last lines) -> ID -> lines."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _CONTAINER_MARK.fullmatch(line.strip())
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return {cid: "\n".join(lines).strip("\n") + "\n" for cid, lines in out.items()}
