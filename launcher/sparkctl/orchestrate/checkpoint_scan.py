"""The checkpoint as a node sees it: probes/ckpt_scan.py (the one reader) run on the node over its SSH
connection. The planner (`sparkctl.spec.planner`, pure) turns what it prints into a `CheckpointInfo`
(`plan.checkpoint_from_scan`); `check`, `up`, `plan` and `render` read the head's checkpoint here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckFailed
from ..facts.parsing import ParseError, parse_json
from ..spec.planner import CheckpointInfo, checkpoint_from_scan, config_or_none
from ..spec.resources import probe_script


class _Runs(Protocol):
    name: str

    def run(self, argv: list[str], *, stdin: bytes | None = ..., timeout: float | None = ...) -> Any: ...


def read_checkpoint_on(node: _Runs, model: Path, drafter: Path | None = None) -> CheckpointInfo:
    """The checkpoint as `node` sees it (MODEL is on the nodes' shared storage, maybe not here), with
    the DSpark drafter's config.json when `drafter` is given."""
    info = checkpoint_from_scan(scan_on(node, model, shards=False), model, node.name)
    if drafter is None:
        return info
    return replace(info, drafter_config=read_drafter_config_on(node, drafter))


def read_drafter_config_on(node: _Runs, drafter: Path) -> dict[str, Any] | None:
    """DSPARK/config.json as `node` sees it; None when it cannot be read (make_plan says so)."""
    return config_or_none(scan_on(node, drafter, shards=False))


def scan_on(node: _Runs, model: Path | str, *, headers: str = "summary", shards: bool = True,
            fingerprints: bool = False, timeout: float = 60.0) -> dict[str, Any]:
    """The checkpoint scan (probes/ckpt_scan.py, the one reader) of `model` on `node`, as a dict.
    CheckFailed when it cannot run or prints something that is not a JSON object."""
    argv = ["python3", "-", str(model), "--headers", headers, *([] if shards else ["--no-shards"]),
            *(["--fingerprints"] if fingerprints else [])]
    r = node.run(argv, stdin=probe_script("ckpt_scan.py"), timeout=timeout)
    fix = f"check that python3 exists on {node.name} and MODEL={model} is readable there"
    if r.exit_code == 127:
        raise CheckFailed(f"python3 is not installed on {node.name}", fix=fix)
    if r.exit_code != 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.exit_code}"])[-1]
        raise CheckFailed(f"cannot read the checkpoint on {node.name}: {last[:300]}", fix=fix)
    try:
        doc = parse_json(r.stdout)
    except ParseError as exc:
        raise CheckFailed(f"the checkpoint scan on {node.name} printed something that is not JSON "
                          f"({str(exc)[:100]})") from None
    if not isinstance(doc, dict):
        raise CheckFailed(f"the checkpoint scan on {node.name} printed something that is not a JSON object")
    return doc
