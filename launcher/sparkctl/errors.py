"""The two kinds of failure a user sees, and the exit code each maps to.

UsageError  -> exit 2: the input is wrong (a key, a value, a missing file). Nothing was started.
CheckFailed -> exit 1: the input is fine but the cluster or the plan says no.
Both carry a message meant for a person: what is wrong, where, and how to fix it.
"""

from __future__ import annotations


class SparkctlError(Exception):
    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"


class UsageError(SparkctlError):
    """Bad input or configuration: exit 2."""

    exit_code = 2


class CheckFailed(SparkctlError):
    """A check, a plan or an operation failed: exit 1."""

    exit_code = 1
