"""`sparkctl deploy`'s pure parts: what a step's probe found (StepPlan), what a step did (StepResult), the
inputs a plan was made from and what differs between two of them, the saved plan's file, and the
reading of `build --dry-run`'s plan as "anything to do". No I/O but the local plan file.

The inputs of a plan (a later `deploy --yes` compares them with the saved plan's and says what differs):
  settings     every resolved setting but the secrets (a secret is recorded by its presence only)
  recipe       sha256 of the recipe file's bytes
  checkpoint   a digest of the head's checkpoint scan: every shard's fingerprint (size, header sha256,
               first/last MiB), every JSON file's sha256 (sync_plan.shard_fp, the sync's own identity)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.sync_plan import shard_fp

# A step's status in `deploy --yes`'s report.
DONE = "done"  # it ran and changed what it says
SKIPPED = "skipped"  # its probe found nothing to do
FAILED = "failed"  # it failed (or was interrupted); later steps were not run
NOT_RUN = "not run"  # an earlier step failed
STATUSES = (DONE, SKIPPED, FAILED, NOT_RUN)


@dataclass
class StepPlan:
    """What a step would do, and why: its probe's answer (a probe changes nothing)."""

    todo: bool
    why: str
    would: list[str] = field(default_factory=list)  # one line per thing it would do (per node, per rank)
    detail: dict[str, Any] = field(default_factory=dict)  # the numbers: bytes per rank, layers per rank, ...

    def as_dict(self) -> dict[str, Any]:
        return {"todo": self.todo, "why": self.why, "would": self.would, "detail": self.detail}


@dataclass
class StepResult:
    """What a step did in `deploy --yes`."""

    step: str
    status: str
    why: str = ""
    changed: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    node: str | None = None
    fix: str | None = None
    seconds: float = 0.0
    interrupted: bool = False

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "status": self.status, "why": self.why, "changed": self.changed,
                             "seconds": round(self.seconds, 3)}
        if self.status == FAILED:
            d.update(error=self.error, node=self.node, fix=self.fix, interrupted=self.interrupted)
        return d


# ------------------------------------------------------------------------------------------ inputs


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def settings_view(values: Mapping[str, Any], secrets: set[str]) -> dict[str, str]:
    """The settings as a plan records them: every value as text, a secret as `(set)` only."""
    return {k: ("(set)" if k in secrets else str(v)) for k, v in sorted(values.items()) if v not in (None, "")}


def checkpoint_fingerprint(scan: Mapping[str, Any] | None) -> str | None:
    """The head's checkpoint as a digest of its scan (None: no scan, or no checkpoint there)."""
    if not scan or scan.get("error") or not scan.get("shards"):
        return None
    shards = {n: shard_fp(e or {}) for n, e in sorted((scan.get("shards") or {}).items())}
    jsons = {n: (e or {}).get("sha256") for n, e in sorted((scan.get("json") or {}).items())}
    return _digest({"shards": shards, "json": jsons})


def inputs(settings: Mapping[str, str], recipe_bytes: bytes, checkpoint: str | None) -> dict[str, Any]:
    return {"settings_hash": _digest(settings), "settings": dict(settings),
            "recipe_hash": hashlib.sha256(recipe_bytes).hexdigest()[:16], "checkpoint": checkpoint}


def diff_inputs(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between a saved plan's inputs and today's, one line each (empty: the same inputs)."""
    out: list[str] = []
    if saved.get("settings_hash") != now.get("settings_hash"):
        a, b = saved.get("settings") or {}, now.get("settings") or {}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"setting {k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}")
        if not out:
            out.append(f"settings hash: {saved.get('settings_hash')} -> {now.get('settings_hash')}")
    if saved.get("recipe_hash") != now.get("recipe_hash"):
        out.append(f"recipe file: {saved.get('recipe_hash')} -> {now.get('recipe_hash')}")
    if saved.get("checkpoint") != now.get("checkpoint"):
        out.append(f"checkpoint on the head: {saved.get('checkpoint') or '(none)'} -> {now.get('checkpoint') or '(none)'}")
    return out


def inputs_key(doc: Mapping[str, Any]) -> str:
    """One digest of a plan's inputs (what the check step remembers it passed with)."""
    return _digest({k: doc.get(k) for k in ("settings_hash", "recipe_hash", "checkpoint")})


# ------------------------------------------------------------------------------------ the saved plan


def state_dir(cluster_name: str) -> Path:
    """Where deploy keeps its plan and state for a cluster, on this machine:
    $XDG_STATE_HOME/sparkctl/<cluster> (default ~/.local/state/sparkctl/<cluster>)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "sparkctl" / cluster_name


def read_doc(path: Path) -> dict[str, Any] | None:
    """A saved document, or None when absent or unreadable (an unreadable plan is no plan)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_doc(path: Path, doc: Mapping[str, Any]) -> None:
    """Written whole or not at all (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def plan_doc(cluster_name: str, ins: Mapping[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"cluster": cluster_name, "made": round(time.time(), 3), "inputs": dict(ins), "steps": steps}


# --------------------------------------------------------------------------------- build's dry run


def build_todo(plan: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> tuple[bool, list[str]]:
    """`build --dry-run`'s plan per node read as (anything to do, one line per node)."""
    todo, lines = False, []
    for node, p in plan.items():
        if "error" in p:
            todo = True
            lines.append(f"{node}: cannot build: {p['error']}")
        elif "steps" in p:
            builds = [s["layer"] for s in p["steps"] if s.get("action") in ("build", "stale", "blocked")]
            if builds:
                todo = True
                lines.append(f"{node}: build {len(builds)} layer(s): {' '.join(builds)}")
            else:
                lines.append(f"{node}: every layer up to date")
        else:
            text = str(p.get("image") or p.get("ship") or "")
            if text.startswith(("nothing", "has ")):
                lines.append(f"{node}: {text}")
            else:
                todo = True
                lines.append(f"{node}: {text}")
    stale = (base or {}).get("stale") or {}
    for node, why in stale.items():
        todo = True
        lines.append(f"{node}: base image {why}")
    return todo, lines
