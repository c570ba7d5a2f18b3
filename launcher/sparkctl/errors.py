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
