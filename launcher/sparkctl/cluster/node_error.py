"""The one failure type of the cluster layer: a node that failed, with a reason and a fix."""

from __future__ import annotations

from typing import Any

from ..errors import CheckFailed


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

