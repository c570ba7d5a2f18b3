"""The supervisor's state file on the head, `~/.sparkctl/<cluster>/watch.json`, which `status` reads.

Written by `sparkctl watch` every round (one small write over its SSH connection); read back as
untrusted data: a file that is not what we write reads as None.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..cluster import Node, NodeError
from ..facts.parsing import ParseError, parse_json
from .lockdir import state_dir

MAX_STATE = 64 * 1024

# Each writer its own temporary file ($$: this shell's pid): watch's heartbeat and its "stopped" may write at
# once, and with one shared name one writer's `cat >` truncated the file the other was about to move in. And
# only a whole document replaces the state (a JSON object ends with "}"): a write whose input was cut short
# (the sender interrupted) must not leave an empty watch.json (seen under load in test_watch_signals).
_WRITE = r'''f="$1"; t="$f.tmp.$$"
umask 077 && mkdir -p -- "${f%/*}" && cat > "$t" && [ "$(tail -c 1 -- "$t")" = "}" ] && mv -f -- "$t" "$f" \
  || { rm -f -- "$t"; exit 1; }'''
_READ = r'''f="$1"; [ -f "$f" ] && head -c 65536 -- "$f" || true'''
_FIELDS = ("state", "detail", "who", "since", "updated", "last_reason")


def state_file(cluster: str) -> str:
    return f"{state_dir(cluster)}/watch.json"


def write_state(head: Node, cluster: str, doc: dict[str, Any]) -> None:
    head.run(["sh", "-c", _WRITE, "sparkctl-watch-state", state_file(cluster)],
             stdin=json.dumps(doc, sort_keys=True).encode(), timeout=20)


def parse_state(text: str, now: float | None = None) -> dict[str, Any] | None:
    """The state as `status` shows it, with `alive` (updated within 3 rounds + 10 s) added."""
    try:
        doc = parse_json(text[:MAX_STATE]) if text.strip() else None
    except ParseError:
        return None
    if not isinstance(doc, dict):
        return None
    out: dict[str, Any] = {k: str(doc[k])[:500] for k in _FIELDS if isinstance(doc.get(k), str)}
    if "state" not in out:
        return None
    for k in ("restarts", "restarts_in_window", "max_restarts", "pid"):
        v = doc.get(k)
        out[k] = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 else None
    epoch, interval = doc.get("updated_epoch"), doc.get("interval_s")
    every = float(interval) if isinstance(interval, int | float) and not isinstance(interval, bool) else 5.0
    age: float | None = None
    if isinstance(epoch, int | float) and not isinstance(epoch, bool):
        age = (now if now is not None else time.time()) - float(epoch)
    out["age_s"] = None if age is None else round(age, 1)
    out["alive"] = age is not None and age <= 3 * every + 10 and out["state"] not in ("stopped", "gave-up")
    return out


def read_state(head: Node, cluster: str) -> dict[str, Any] | None:
    try:
        r = head.run(["sh", "-c", _READ, "sparkctl-watch-state", state_file(cluster)], timeout=20)
    except NodeError:
        return None
    return parse_state(r.stdout) if r.ok else None


def describe(st: dict[str, Any] | None) -> str:
    """One line for `status`."""
    if st is None:
        return "supervisor: none has run (`sparkctl watch`, or `sparkctl export systemd`)"
    if not st["alive"]:
        last = f"{st['state']}" + (f": {st['detail']}" if st.get("detail") else "")
        return f"supervisor: not running (last seen {st.get('updated', '?')}, {last})"
    restarts = f"; {st['restarts']} restart(s), {st['restarts_in_window']}/{st['max_restarts']} in the window" \
        if st.get("restarts") else ""
    return (f"supervisor: {st['state']}" + (f" ({st['detail']})" if st.get("detail") else "")
            + f", pid {st.get('pid')} by {st.get('who')}, updated {st['age_s']}s ago{restarts}")
