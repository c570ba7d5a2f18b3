"""The two kinds of failure a user sees, the exit code each maps to, and the one shape `--json` gives a failure.

UsageError  -> exit 2: the input is wrong (a key, a value, a missing file). Nothing was started.
CheckFailed -> exit 1: the input is fine but the cluster or the plan says no.
Both carry a message meant for a person: what is wrong, where, and how to fix it. With --json, every failure
of every command is one document of one shape, written here only (`failure_document`, data/failure.schema.json):
`ok` false, `error` (one line, the reason), `fix` (or null when there is none), `node` (the one node it is about,
else null), `failures` (each node's own: node, kind, reason, fix) and `exit_code`; a command's own keys (check's
findings) may sit beside them. A command that has its own report raises with it (`extra`): cli.main prints the
document, so the exit status and `exit_code` are one number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent / "data" / "failure.schema.json"
SHAPE_KEYS = ("ok", "error", "fix", "node", "failures", "exit_code")


@dataclass(frozen=True)
class Failure:
    """One node's (or rank's) own part of a failure."""

    node: str | None
    kind: str
    reason: str
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "kind": self.kind, "reason": self.reason, "fix": self.fix}


def _failure_dict(f: Failure | dict[str, Any]) -> dict[str, Any]:
    d = f.as_dict() if isinstance(f, Failure) else dict(f)
    reason = " ".join(str(d.get("reason") or d.get("error") or "failed").split())
    return {**d, "node": d.get("node"), "kind": str(d.get("kind") or "error"), "reason": reason,
            "fix": d.get("fix") or None}


def failure_document(error: str, *, exit_code: int, fix: str | None = None, node: str | None = None,
                     failures: list[Failure] | list[dict[str, Any]] | None = None,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The failure as `--json` prints it (data/failure.schema.json). `error`'s first line is the error; its
    other lines, when no `failures` say them, are kept as `details`. With no fix of its own, the failures'
    fixes are the fix (one, or each node's)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()] or [f"failed with exit status {exit_code}"]
    rows = [_failure_dict(f) for f in failures or []]
    head = lines[0]
    if head.endswith(":"):
        named = [str(r["node"]) for r in rows if r["node"]]
        head = head[:-1] + (f": {', '.join(dict.fromkeys(named))}" if named else "")
    if not fix:
        fixes = list(dict.fromkeys(str(r["fix"]) for r in rows if r["fix"]))
        fix = fixes[0] if len(fixes) == 1 else "; ".join(
            f"{r['node'] or r['kind']}: {r['fix']}" for r in rows if r["fix"]) or None
    doc: dict[str, Any] = dict(extra or {})
    if len(lines) > 1 and not rows:
        doc["details"] = lines[1:]
    doc.update(ok=False, error=head, fix=fix or None, node=node, failures=rows, exit_code=int(exit_code))
    return doc


class SparkctlError(Exception):
    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None, node: str | None = None,
                 failures: list[Failure] | list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None,
                 shown: bool = False, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.node = node  # the one node it is about, when it is about one
        self.failures = failures  # per node (node, kind, reason, fix), when several nodes failed
        self.extra = extra  # the command's own report, printed beside the failure's keys with --json
        self.shown = shown  # the command's own output already said it: cli.main prints no `error:` line
        if exit_code is not None:
            self.exit_code = exit_code

    def to_json(self) -> dict[str, Any]:
        """The failure as `--json` prints it (failure_document)."""
        return failure_document(self.message, exit_code=self.exit_code, fix=self.fix, node=self.node,
                                failures=self.failures, extra=self.extra)

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"


class UsageError(SparkctlError):
    """Bad input or configuration: exit 2."""

    exit_code = 2


class CheckFailed(SparkctlError):
    """A check, a plan or an operation failed: exit 1."""

    exit_code = 1


class NodeError(CheckFailed):
    """One node failed; `kind` says how (for rules and tests), `reason` and `fix` say it to a person.

    kinds: config dns refused timeout unreachable proxy protocol auth hostkey-unknown hostkey-changed
           hostkey-revoked hostkey-cert unsupported lost command-timeout docker output sftp error
    """

    def __init__(
        self,
        node: str,
        kind: str,
        reason: str,
        fix: str | None = None,
        *,
        key_type: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        super().__init__(f"{node}: {reason}", fix=fix, node=node)
        self.node: str = node
        self.kind = kind
        self.reason = reason
        self.key_type = key_type
        self.fingerprint = fingerprint

    def to_json(self) -> dict[str, Any]:
        doc = failure_document(self.message, exit_code=self.exit_code, fix=self.fix, node=self.node,
                               failures=self.failures or [self.as_dict()], extra=self.extra)
        return doc | {k: v for k, v in self.as_dict().items() if k not in ("node", "fix")}

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"node": self.node, "kind": self.kind, "reason": self.reason, "fix": self.fix}
        if self.fingerprint:
            d.update(key_type=self.key_type, fingerprint=self.fingerprint)
        return d
