"""`sparkctl setup`'s flow: discover every node (one probe, one connection each, in parallel), find the
cabling, plan the exact files and commands (spec/setup_plan.py), and with `--yes` apply them per node.

Apply, per node, in parallel, under the cluster lock: probes/setup_apply.sh as root (or `sudo -n`): every
file validated by the real tool before one is renamed into place; netplan last, with try semantics: the
node restores its old netplan file by itself unless this machine, from a NEW SSH connection, confirms it
still reaches the node. A node that fails is reported with its fix; the others complete. Every file
written and command run is an audit line on its node.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cluster import Cluster, Node, NodeError, parallel
from ..errors import CheckFailed, UsageError
from ..facts.parsing import ParseError
from ..facts.setup_facts import SetupFacts, parse_iperf3, setup_facts_from_probe
from ..remote.lockdir import audit_append_argv, audit_line
from ..rules.cabling import Cabling, End, find_cabling, judge_speeds
from ..rules.findings import Needs
from ..spec.resources import probe_script
from ..spec.settings import Settings
from ..spec.setup_plan import (
    DEFAULT_FABRIC_SUBNET,
    NodePlan,
    SetupInputError,
    Wanted,
    allocate,
    check_subnet,
    fabric_doc_path,
    plan_setup,
    refuse_bad_nodes,
)
from .locking import lock_cluster

TRY_S = 120  # a node that this machine cannot reach again within this restores its old netplan file
# Root runs it as it is; anyone else through `sudo -n` (never a password). Under the tests' and the lab's root
# seam (SPARKCTL_SETUP_ROOT) nothing needs root.
AS_ROOT = ('if [ "$(id -u)" = 0 ] || [ -n "${SPARKCTL_SETUP_ROOT:-}" ]; then exec sh -c "$@"; fi\n'
           'exec sudo -n sh -c "$@"')
# The confirmation claims the try by renaming its mark (the node's timer does the same: one of them wins).
CONFIRM = ('R=${SPARKCTL_SETUP_ROOT:-}; d="$R/etc/sparkctl/$1"\n'
           'mv -- "$d/netplan.pending" "$d/netplan.confirmed" 2>/dev/null || { echo "the netplan try already ended: '
           'the node restores its old file" >&2; exit 3; }\nrm -f -- "$d/netplan.confirmed" "$d/netplan.prev"')


@dataclass
class NodeOutcome:
    status: str  # nothing | applied | failed | by-hand
    wrote: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    error: str | None = None
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "wrote": self.wrote, "ran": self.ran, "error": self.error, "fix": self.fix}


@dataclass
class SetupReport:
    subnet: str
    cabling: Cabling
    facts: dict[str, SetupFacts]
    plans: dict[str, NodePlan]
    addresses: dict[End, str] = field(default_factory=dict)
    applied: dict[str, NodeOutcome] | None = None
    speeds: dict[str, float | str] | None = None  # cable -> Gbit/s, or why it was not measured
    speed_warnings: list[str] = field(default_factory=list)

    @property
    def changes(self) -> list[dict[str, Any]]:
        return [c.as_dict() for p in self.plans.values() for c in p.changes]

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "ok": not self.failed, "fabric_subnet": self.subnet, "cabling": self.cabling.as_dict(),
            "changes": self.changes,
            "nodes": {n: {"right": p.right, "warnings": p.warnings, "privileged": p.privileged,
                          "by_hand": [] if p.privileged or not p.changes else p.by_hand(),
                          "ssh_interface": self.facts[n].ssh_iface,
                          "ports": [vars(x) | {"ipv4": list(x.ipv4)} for x in self.facts[n].ports]}
                      for n, p in self.plans.items()}}
        if self.applied is not None:
            doc["applied"] = {n: o.as_dict() for n, o in self.applied.items()}
        if self.speeds is not None:
            doc["cables"] = [{"cable": c, "gbit_per_s": v if isinstance(v, float) else None,
                              "error": v if isinstance(v, str) else None} for c, v in self.speeds.items()]
            doc["speed_warnings"] = self.speed_warnings
        return doc

    @property
    def failed(self) -> list[str]:
        return [n for n, o in (self.applied or {}).items() if o.status in ("failed", "by-hand")]


def discover(cluster: Cluster, s: Settings, *, neighbours: bool = True) -> dict[str, SetupFacts]:
    """setup_facts.sh on every node at once; a node that does not answer stops setup (exit 1). neighbours=False
    leaves out the cabling's neighbour discovery (its bounded ping of every port's link)."""
    if cluster.errors:
        raise CheckFailed("setup needs every node: " + "; ".join(e.message for e in cluster.errors.values()),
                          fix="make every node of NODES reachable over SSH (`sparkctl check` says why), then run "
                              "`sparkctl setup` again", node=next(iter(cluster.errors)) if len(cluster.errors) == 1
                          else None, failures=[e.as_dict() for e in cluster.errors.values()])
    script = probe_script("setup_facts.sh")
    nonce = secrets.token_hex(8)

    def one(node: Node) -> SetupFacts:
        r = node.run_script(script, [nonce, fabric_doc_path(s.cluster_name), "yes" if neighbours else "no"],
                            timeout=60)
        return setup_facts_from_probe(r.stdout, nonce, r.stderr)

    res = cluster.run_all(one, nodes=s.nodes)
    res.raise_if_failed("the setup probe")
    return dict(res.ok)


def document_disagrees(cluster: Cluster, s: Settings) -> str | None:
    """Whether setup has fabric work to do, cheaply (no neighbour discovery): None when every node holds this
    cluster's fabric document and each port it records is there, up, with its address and MAC; else why not."""
    facts = discover(cluster, s, neighbours=False)
    for n in s.nodes:
        doc = facts[n].fabric_doc
        ports = doc.get("ports") if isinstance(doc, dict) else None
        mine = ports.get(n) if isinstance(ports, dict) else None
        if not isinstance(mine, dict) or not mine:
            return f"{n} has no fabric document of cluster {s.cluster_name!r}"
        for name, rec in sorted(mine.items()):
            rec = rec if isinstance(rec, dict) else {}
            live = facts[n].port(str(name))
            if live is None or not live.carrier:
                return f"{n}: port {name} is {'gone' if live is None else 'down'} (the fabric document has it)"
            if rec.get("address") not in live.ipv4:
                return f"{n}: port {name} lacks {rec.get('address')}, its address in the fabric document"
            if isinstance(rec.get("mac"), str) and live.mac and live.mac.lower() != str(rec["mac"]).lower():
                return f"{n}: port {name}'s MAC is not the one in the fabric document"
    return None


def plan(cluster: Cluster, s: Settings) -> SetupReport:
    """Discover and plan; changes nothing. Bad input is a UsageError (exit 2) before anything is touched."""
    facts = discover(cluster, s)
    for n in s.nodes:
        if facts[n].problems and not facts[n].ports:
            raise CheckFailed(f"{n}: " + "; ".join(facts[n].problems[:3]))
    subnet = s.get("FABRIC_SUBNET") or DEFAULT_FABRIC_SUBNET
    try:
        refuse_bad_nodes(s.nodes, facts)
        management = [m for f in facts.values() for m in f.ssh_nets]
        management += [f"{f.client_ip}/32" for f in facts.values() if f.client_ip]
        net = check_subnet(str(subnet), management)
        group = list(s.topology.replicas[0].nodes)
        cabling = find_cabling(s.nodes, {n: f.ports for n, f in facts.items()},
                               {n: f.neighbours for n, f in facts.items()}, group)
        if cabling.errors:
            raise SetupInputError(cabling.errors[0])
        addrs = allocate(cabling, net)
    except SetupInputError as exc:
        raise UsageError(str(exc)) from None
    needs = Needs.from_settings(s)
    want = Wanted(s.cluster_name, tuple(s.nodes), needs.nofile, needs.memlock_bytes)
    return SetupReport(str(net), cabling, facts, plan_setup(want, facts, cabling, addrs),
                       {e: str(a.ip) for e, a in addrs.items()})


def apply(cluster: Cluster, s: Settings, report: SetupReport, ssh_config: str | Path | None,
          try_s: int = TRY_S) -> SetupReport:
    """Every node's changes, in parallel, under the cluster lock; report.applied says how each went."""
    todo = [n for n, p in report.plans.items() if p.changes]
    report.applied = {n: NodeOutcome("nothing") for n in report.plans if n not in todo}
    if not todo:
        return report
    with lock_cluster(cluster, todo, s.cluster_name, "setup"):
        res = cluster.run_all(lambda node: _apply_node(node, report.plans[node.name], s, ssh_config, try_s),
                              nodes=todo)
    for n, r in res.items():
        report.applied[n] = r if isinstance(r, NodeOutcome) else NodeOutcome(
            "failed", error=r.reason, fix=r.fix or "fix what the message names, then run `sparkctl setup` again")
    return report


def _apply_node(node: Node, p: NodePlan, s: Settings, ssh_config: str | Path | None, try_s: int) -> NodeOutcome:
    if not p.privileged:
        return NodeOutcome("by-hand", error=f"{node.name}: sudo asks for a password: setup does not ask for one",
                           fix=f"run these on {node.name}, then `sparkctl setup` again:\n    "
                               + "\n    ".join(p.by_hand()))
    records: list[str] = []
    for f in p.files:
        records += ["file", f.path, f.mode, f.check, f.content]
    for action, arg in p.commands:
        records += ["cmd", action, arg]
    argv = ["sh", "-c", AS_ROOT, "sparkctl-as-root", probe_script("setup_apply.sh").decode(), "sparkctl-setup",
            s.cluster_name, str(try_s), *records]
    r = node.run(argv, timeout=900)
    out = NodeOutcome("applied")
    for line in r.stdout.splitlines():
        if line.startswith("@@sparkctl-wrote "):
            out.wrote.append(line.removeprefix("@@sparkctl-wrote "))
        elif line.startswith("@@sparkctl-ran "):
            out.ran.append(line.removeprefix("@@sparkctl-ran "))
    audit = [audit_line(action="setup", detail=f"wrote {w}") for w in out.wrote]
    audit += [audit_line(action="setup", detail=f"ran {a}") for a in out.ran]
    if not r.ok:
        said = r.stderr.rpartition("@@sparkctl-setup-error ")[2] if "@@sparkctl-setup-error " in r.stderr else (
            r.stderr.strip() or f"exit {r.exit_code}")
        msg = " ".join(said.split())[:400]
        audit.append(audit_line(action="setup-failed", detail=msg))
        node.run(audit_append_argv(s.cluster_name, audit), timeout=20)
        return NodeOutcome("failed", out.wrote, out.ran, f"{node.name}: {msg}",
                           "fix what the message names on the node, then run `sparkctl setup` again (files not "
                           "listed as written were left as they were)")
    if "@@sparkctl-netplan pending" in r.stdout:
        err = _confirm(node, s, ssh_config)
        if err:
            audit.append(audit_line(action="setup-failed", detail=err))
            node.run(audit_append_argv(s.cluster_name, audit), timeout=20)
            return NodeOutcome("failed", out.wrote, out.ran, f"{node.name}: {err}",
                               f"{node.name} restores its previous netplan file within {try_s} s by itself; check "
                               "that no fabric address clashes with its SSH network, then run `sparkctl setup` again")
        out.ran.append("netplan-apply")
        audit.append(audit_line(action="setup", detail="ran netplan-apply (confirmed over a new SSH connection)"))
    node.run(audit_append_argv(s.cluster_name, audit), timeout=20)
    return out


def _confirm(node: Node, s: Settings, ssh_config: str | Path | None) -> str | None:
    """A new SSH connection to the node (the old one may survive what a new one would not); on success, end
    the node's netplan try. Returns why it could not, or None."""
    try:
        with Cluster([node.name], ssh_config, connect_timeout=20) as again:
            if again.errors:
                return f"no new SSH connection after netplan apply ({again.errors[node.name].reason})"
            r = again.node(node.name).run(["sh", "-c", AS_ROOT, "sparkctl-as-root", CONFIRM, "sparkctl-confirm",
                                           s.cluster_name], timeout=30)
    except NodeError as exc:
        return f"no new SSH connection after netplan apply ({exc.reason})"
    if not r.ok:
        return f"the netplan try could not be confirmed: {r.stderr.strip()[-300:]}"
    return None


SPEED_PORT = 5201  # iperf3's own port, on the fabric addresses only
SPEED_SECONDS = 3


def measure_cables(cluster: Cluster, s: Settings, report: SetupReport, seconds: int = SPEED_SECONDS) -> SetupReport:
    """Each cable's bandwidth, one cable at a time (a node in a ring holds two): iperf3 between its two ends'
    fabric addresses, 4 streams, against the recipe's floor (busbw_floor_gbps, as Gbit/s). A slow cable is a
    warning naming both ends, never a failure."""
    script = probe_script("cable_speed.sh").decode()
    speeds: dict[str, float | str] = {}
    for seg in report.cabling.segments:
        if not seg.is_cable:
            continue
        (a, pa), (b, pb) = seg.ends
        ia, ib = report.addresses.get((a, pa)), report.addresses.get((b, pb))
        if not ia or not ib or a in report.failed or b in report.failed:
            speeds[seg.describe()] = "its addresses are not set up"
            continue

        def end(node: str, role: str, addr: str, peer: str) -> Any:
            return cluster.node(node).run(["sh", "-c", script, "cable-speed", role, addr, peer, str(SPEED_PORT),
                                           str(seconds)], timeout=seconds + 60)

        served, got = parallel([functools.partial(end, b, "serve", ib, ia), functools.partial(end, a, "measure", ia, ib)])
        try:
            speeds[seg.describe()] = round(parse_iperf3(got.stdout) / 1e9, 2)
        except ParseError as exc:
            said = str(exc) if got.stdout.strip() else got.stderr.strip() or served.stderr.strip() or str(exc)
            speeds[seg.describe()] = said[-200:]
    report.speeds = speeds
    report.speed_warnings = judge_speeds(speeds, s.recipe.fabric.busbw_floor_gbps * 8)
    return report
