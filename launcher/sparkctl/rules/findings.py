"""The words every rule speaks: a `Finding` and its statuses, and `Needs` (what the settings and
recipe ask of every node, distilled so the rules need no Settings).

`check` (its rules), `nic_pins` (fabric discovery), `orchestrate.fabric_test` (check --fabric), `nccl` (NCCL_DEBUG
findings) and `verify` (the checkpoint rules: `check`'s `checkpoint` row, `verify-model`, `model
sync`) all return Findings; the commands print them. Pure: no I/O.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..facts import node_facts as F
from ..spec.settings import RankPins, Settings

OK, FAIL, WARN, SKIP, INFO = "ok", "fail", "warn", "skip", "info"
SYMBOL = {OK: "✓", FAIL: "✗", WARN: "!", SKIP: "·", INFO: "i"}
# A status in the checkpoint reports' words (verify-model's and model sync's "severity").
SEVERITY = {FAIL: "error", WARN: "warn", INFO: "info"}
CLUSTER_ROW = "(cluster)"

# The container variables that carry a rank's own fabric pins (builders.rank_env): what each must name.
PIN_ENV = {"NCCL_SOCKET_IFNAME": "netdev", "GLOO_SOCKET_IFNAME": "netdev", "NCCL_IB_HCA": "rdma_dev",
           "NCCL_IB_GID_INDEX": "gid_index", "VLLM_HOST_IP": "fabric_ip"}


@dataclass(frozen=True)
class Finding:
    node: str  # a node alias, or CLUSTER_ROW for what concerns the whole cluster
    check: str
    status: str  # ok | fail | warn | skip | info (said, neither good nor bad)
    short: str  # the table cell
    reason: str = ""  # the whole story (defaults to short)
    fix: str = ""
    code: str = ""  # the rule's own name within its check, e.g. "shard-missing" (the checkpoint rules)
    where: str = ""  # the file, tensor or node within `node` that it is about

    @property
    def text(self) -> str:
        return self.reason or self.short

    @property
    def severity(self) -> str:
        """The status in the checkpoint reports' words: error, warn, info."""
        return SEVERITY.get(self.status, self.status)

    def to_dict(self) -> dict[str, str]:
        return {"node": self.node, "check": self.check, "status": self.status, "short": self.short,
                "reason": self.text, "fix": self.fix}


@dataclass(frozen=True)
class Needs:
    """What the settings and recipe ask of every node, distilled so the rules need no Settings."""

    nofile: int
    memlock_bytes: int  # -1: unlimited
    gpus_per_node: int
    port: int
    master_port: int
    fabric_subnet: ipaddress.IPv4Network | None
    image: str
    cluster: str
    model: str
    given_pins: tuple[RankPins, ...] = ()
    base_image: str = ""  # BASE_IMAGE: every rank must hold the head's (sparkctl.image.base_image)
    expect: tuple[tuple[str, str], ...] = ()  # versions the recipe expects of the chain (its layers' expect)
    prebuilt: str = ""  # the recipe runs a published image: where it comes from (no chain, no base)
    pin_env: tuple[tuple[str, str], ...] = ()  # pin keys the recipe's [container.env] sets for every rank
    recipe_path: str = ""

    @classmethod
    def from_settings(cls, s: Settings) -> Needs:
        subnet = s.get("FABRIC_SUBNET")
        return cls(
            nofile=s.getint("ULIMIT_NOFILE"),
            memlock_bytes=s.getint("ULIMIT_MEMLOCK"),
            gpus_per_node=int(s.get("GPUS_PER_NODE", 1)),
            port=s.getint("PORT"),
            master_port=s.getint("MASTER_PORT"),
            fabric_subnet=ipaddress.IPv4Network(subnet, strict=False) if subnet else None,
            image=s.image,
            cluster=s.cluster_name,
            model=str(s.model),
            given_pins=tuple(s.rank_pins(r) for r in range(len(s.nodes))),
            base_image="" if s.recipe.prebuilt else str(s.get("BASE_IMAGE") or ""),
            prebuilt=s.recipe.prebuilt.source if s.recipe.prebuilt else "",
            pin_env=tuple(sorted((k, v) for k, v in s.recipe.container.env.items() if k in PIN_ENV)),
            recipe_path=str(s.recipe.path),
            expect=tuple(sorted({k: v for layer in s.recipe.layers for k, v in layer.expect.items()}.items())),
        )

def finding(node: str, check: str, status: str, short: str, reason: str = "", fix: str = "") -> Finding:
    return Finding(node, check, status, short, reason, fix)


def unknown(node: str, check: str, facts: F.NodeFacts, section: str) -> Finding:
    why = facts.problems.get(section, "not reported")
    return finding(
        node,
        check,
        FAIL,
        "unreadable",
        f"{node}: could not read {section}: {why}",
        f"run the probe by hand on {node} to see why: sh -s < probes/node_facts.sh",
    )
