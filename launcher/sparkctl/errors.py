"""The two kinds of failure a user sees, and the exit code each maps to.

UsageError  -> exit 2: the input is wrong (a key, a value, a missing file). Nothing was started.
CheckFailed -> exit 1: the input is fine but the cluster or the plan says no.
Both carry a message meant for a person: what is wrong, where, and how to fix it; with --json,
`to_json()` is the failure's document (cli.main prints it when the command printed none).
"""

from __future__ import annotations

from typing import Any


class SparkctlError(Exception):
    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None, node: str | None = None,
                 failures: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.node = node  # the one node it is about, when it is about one
        self.failures = failures  # per node (node, kind, reason, fix), when several nodes failed

    def to_json(self) -> dict[str, Any]:
        """The failure as `--json` prints it: `ok: false`, the error, the node, the fix, the exit code."""
        doc: dict[str, Any] = {"ok": False, "error": self.message, "node": self.node, "fix": self.fix,
                               "exit_code": self.exit_code}
        if self.failures:
            doc["failures"] = self.failures
        return doc

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
        return {**super().to_json(), **{k: v for k, v in self.as_dict().items() if k not in ("node", "fix")}}

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"node": self.node, "kind": self.kind, "reason": self.reason, "fix": self.fix}
        if self.fingerprint:
            d.update(key_type=self.key_type, fingerprint=self.fingerprint)
        return d
