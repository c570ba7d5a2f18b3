"""`sparkctl model pull`'s flow: MODEL_REPO@MODEL_REVISION -> MODEL on the head, then verified there.

`pull_on_head` runs probes/hf_pull.py on the head with its own python (HF_PYTHON, which needs
huggingface_hub), over one SSH connection; the token follows the script on stdin (`BOOT`). `verify_head`
is verify-model's cluster check limited to the head. Flags and printing: commands/model.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..checkpoint.verify import Report
from ..cluster import Cluster, RunResult
from ..errors import CheckFailed
from ..facts.parsing import ParseError, parse_json
from ..spec.resources import probe_script
from .locking import lock_cluster
from .verify_model import verify_cluster

PULL_TIMEOUT = 48 * 3600.0
# The head's python reads the script's N bytes from stdin, then the script reads the token line.
BOOT = ("import sys;n=int(sys.argv.pop(1));src=sys.stdin.buffer.read(n);"
        "exec(compile(src,'hf_pull.py','exec'),{'__name__':'__main__'})")


def pull_on_head(s: Any, ssh_config: Any, repo: str, revision: str, *, started: Callable[[str], None],
                 progress: Callable[[int, int, float], None]) -> dict[str, Any]:
    """Run probes/hf_pull.py on the head with its HF_PYTHON, the token after the script on stdin; its last
    JSON line is the answer (status: downloaded, up-to-date, no-space, error). `started(head)` once it
    runs, `progress(bytes, total, seconds)` as it goes."""
    script = probe_script("hf_pull.py")
    token = s.secrets().get("HF_TOKEN", "")
    env = {"HF_HUB_DISABLE_TELEMETRY": "1"}
    if s.get("HF_ENDPOINT"):
        env["HF_ENDPOINT"] = str(s.get("HF_ENDPOINT"))
    python = str(s.get("HF_PYTHON") or "python3")
    head = s.head
    with Cluster([head], ssh_config) as cluster:
        if head in cluster.errors:
            err = cluster.errors[head]
            raise CheckFailed(f"the head {head} is unreachable: {err.reason}", fix=err.fix)
        with lock_cluster(cluster, [head], s.cluster_name, "model pull"):  # it writes MODEL on the head
            session = cluster.node(head).start([python, "-c", BOOT, str(len(script)), repo, revision, str(s.model)],
                                               env=env, timeout=PULL_TIMEOUT)
            t0 = time.monotonic()
            started(head)
            # The script and the token go in; the script says @@ready once it has read the token.
            session.read_until(b"@@ready\n", stdin=script + token.encode() + b"\n")
            result = _drive(session, progress, t0)
    return answer_of(result, head, python)


def answer_of(result: RunResult, head: str, python: str) -> dict[str, Any]:
    """hf_pull.py's last JSON line (untrusted: the head printed it); CheckFailed naming the head when
    there is none, or it is not a JSON object."""
    lines = [ln for ln in result.stdout.splitlines() if ln.strip().startswith("{")]
    try:
        doc = parse_json(lines[-1]) if lines else {}
    except ParseError:
        doc = {}
    if not doc or not isinstance(doc, dict):
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise CheckFailed(f"{head}: the download did not run (exit {result.exit_code}): {tail}",
                          fix=f"check that {python} exists on {head} (HF_PYTHON) and has huggingface_hub")
    return doc


def raise_for_status(doc: dict[str, Any], s: Any, repo: str, revision: str) -> None:
    """hf_pull.py's answer: CheckFailed with the fix when it says no-space or error (nothing else raises)."""
    head, status = s.head, doc.get("status")
    if status == "no-space":
        raise CheckFailed(f"{head}:{s.model}: {repo}@{doc.get('commit')} needs {int(doc['need_bytes']):,} B, the "
                          f"filesystem has {int(doc['free_bytes']):,} B free (the repo is {int(doc['total_bytes']):,} B); "
                          "nothing was downloaded", fix=f"free space on {head} or point MODEL at a bigger disk",
                          node=head)
    if status == "error":
        fix = (f"install it on {head} (pip install 'huggingface_hub>=0.24') or set HF_PYTHON to a python that has it"
               if doc.get("code") == "no-huggingface-hub" else
               "check MODEL_REPO / MODEL_REVISION, HF_TOKEN for a gated repo, and HF_ENDPOINT")
        raise CheckFailed(f"{head}: pulling {repo}@{revision} failed: {doc.get('code')}: {doc.get('message')}", fix=fix,
                          node=head)


def _drive(session: Any, progress: Callable[[int, int, float], None], started: float) -> RunResult:
    """Read the pull's progress lines until it ends."""
    pending = ""
    while session.poll(0.5):
        pending += bytes(session.err).decode("utf-8", "replace")
        del session.err[:]
        *done_lines, pending = pending.split("\n")
        for line in done_lines:
            if line.startswith("@@progress "):
                try:
                    p = parse_json(line[len("@@progress "):])
                    progress(int(p["bytes"]), int(p["total"]), time.monotonic() - started)
                except (ValueError, KeyError, TypeError):  # ParseError is a ValueError
                    pass
    res: RunResult = session.finish()
    return res


def verify_head(s: Any, ssh_config: Any, layout: dict[str, Any] | None) -> Report:
    """verify-model's cluster check, on the head only (what was just downloaded there)."""
    report, _ = verify_cluster(_HeadOnly(s), ssh_config, layout, False, 100 * 1024 * 1024)
    return report


class _HeadOnly:
    """Settings as verify-model's cluster mode reads them, limited to the head."""

    def __init__(self, s: Any) -> None:
        self._s = s
        self.nodes = [s.head]
        self.model = s.model
