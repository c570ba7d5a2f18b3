"""The cabling, from what each CX7 port saw: which port of which node is cabled to which port of which node.

Found without any daemon: every port pings all hosts of its link (ff02::1), and its IPv6 neighbour table
then holds the MAC of every port on the other end. A MAC that belongs to another node's CX7 port is a
peer. A GB10 shows each physical port as two netdevs (PCIe twins): one twin speaks for the port (`primaries`). Ports that see each other form a *segment*: two ports are a cable, more are a switch.

The layout, named: `switch` (every cabled port on one segment), `direct pair` (two nodes, one or two
cables between them), `ring` / `line` (cables between neighbours), `none`, or `mixed`. Then whether it
carries one TP group (NODES' first TP nodes): every rank must reach its neighbour ranks (ring all-reduce):
a switch carries any TP, a pair carries TP=2, a ring carries its nodes in its order, a line does not
close the ring. What to move is said exactly: the ports to cable, or NODES' order that matches the cables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..facts.setup_facts import Port

End = tuple[str, str]  # (node, port)


def twin_key(port: str) -> str:
    """The physical port a netdev belongs to: a GB10's CX7 shows each QSFP port as two PCIe twins
    (`enp1s0f0np0` and `enP2p1s0f0np0`), told apart only by the PCI domain in the name."""
    return re.sub(r"^enP\d+p", "enp", port)


def primaries(ports: Sequence[Port]) -> dict[str, str]:
    """netdev -> the twin that stands for its physical port (the one named without a PCI domain, else the
    first by name): cabling, addresses and the fabric document use it; the other twin is left as it is."""
    by_key: dict[str, list[str]] = {}
    for p in ports:
        by_key.setdefault(twin_key(p.name), []).append(p.name)
    return {name: min(names, key=lambda x: (x != key, x)) for key, names in by_key.items() for name in names}


@dataclass(frozen=True)
class Segment:
    """Ports that see each other, sorted by (node's position in NODES, port)."""

    ends: tuple[End, ...]

    @property
    def is_cable(self) -> bool:
        return len(self.ends) == 2

    def describe(self) -> str:
        return " <-> ".join(f"{n}:{p}" for n, p in self.ends)


@dataclass
class Cabling:
    segments: list[Segment] = field(default_factory=list)
    layout: str = "none"
    errors: list[str] = field(default_factory=list)  # cabling that is wrong: nothing is applied
    moves: list[str] = field(default_factory=list)  # the layout cannot carry TP: exactly what to move
    notes: list[str] = field(default_factory=list)

    def peers(self, node: str, port: str) -> list[End]:
        for s in self.segments:
            if (node, port) in s.ends:
                return [e for e in s.ends if e != (node, port)]
        return []

    def cabled(self, node: str) -> list[str]:
        return sorted(p for s in self.segments for n, p in s.ends if n == node)

    def as_dict(self) -> dict[str, object]:
        return {"layout": self.layout, "segments": [[f"{n}:{p}" for n, p in s.ends] for s in self.segments],
                "errors": self.errors, "moves": self.moves, "notes": self.notes}


def find_cabling(nodes: Sequence[str], ports: Mapping[str, Sequence[Port]],
                 neighbours: Mapping[str, Mapping[str, Sequence[str]]], group: Sequence[str]) -> Cabling:
    """The segments, the layout's name, and what is wrong with it for one TP group of `group`'s nodes."""
    order = {n: i for i, n in enumerate(nodes)}
    owner: dict[str, End] = {}
    prim = {n: primaries(ports.get(n, ())) for n in nodes}
    for n in nodes:
        for p in ports.get(n, ()):
            if p.mac:
                owner[p.mac] = (n, prim[n][p.name])
    out = Cabling()
    edges: dict[End, set[End]] = {}
    looped: set[frozenset[str]] = set()
    for n in nodes:
        for p in ports.get(n, ()):
            if prim[n][p.name] != p.name:
                continue  # a twin: its primary speaks for the physical port
            seen_peers = [owner[m] for m in neighbours.get(n, {}).get(p.name, ()) if m in owner]
            # a port that sees other nodes too is on a shared segment (a switch) where its node's other port may
            # also be: that is no cable to itself
            on_segment = any(peer[0] != n for peer in seen_peers)
            for peer in seen_peers:
                if peer == (n, p.name) or (peer[0] == n and on_segment):
                    continue
                if peer[0] == n:
                    if frozenset((p.name, peer[1])) not in looped:
                        looped.add(frozenset((p.name, peer[1])))
                        out.errors.append(f"{n}: port {p.name} is cabled to its own port {peer[1]}: move one "
                                          "end of that cable to a CX7 port of another node")
                    continue
                edges.setdefault((n, p.name), set()).add(peer)
                edges.setdefault(peer, set()).add((n, p.name))
    seen: set[End] = set()
    for start in sorted(edges, key=lambda e: (order[e[0]], e[1])):
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            e = todo.pop()
            if e in comp:
                continue
            comp.add(e)
            todo.extend(edges.get(e, ()))
        seen |= comp
        out.segments.append(Segment(tuple(sorted(comp, key=lambda e: (order[e[0]], e[1])))))
    _name_layout(out, nodes)
    if not out.errors:
        _judge(out, nodes, ports, group)
    return out


def _node_links(c: Cabling) -> dict[str, set[str]]:
    links: dict[str, set[str]] = {}
    for s in c.segments:
        ns = {n for n, _ in s.ends}
        for n in ns:
            links.setdefault(n, set()).update(ns - {n})
    return links


def _name_layout(c: Cabling, nodes: Sequence[str]) -> None:
    if not c.segments:
        c.layout = "none"
        return
    switches = [s for s in c.segments if not s.is_cable]
    if switches:
        c.layout = "switch" if len(c.segments) == 1 else "mixed"
        return
    links = _node_links(c)
    cabled = [n for n in nodes if n in links]
    if len(cabled) == 2:
        c.layout = "direct pair"
    elif all(len(v) == 2 for v in links.values()) and _connected(cabled, links):
        c.layout = "ring"
    elif all(len(v) <= 2 for v in links.values()) and _connected(cabled, links):
        c.layout = "line"
    else:
        c.layout = "mixed"


def _connected(names: Sequence[str], links: Mapping[str, set[str]]) -> bool:
    if not names:
        return True
    reach, todo = set(), [names[0]]
    while todo:
        n = todo.pop()
        if n not in reach:
            reach.add(n)
            todo.extend(links.get(n, ()))
    return reach >= set(names)


def _free(node: str, ports: Mapping[str, Sequence[Port]], c: Cabling) -> str:
    used = set(c.cabled(node))
    prim = primaries(ports.get(node, ()))
    free = [p.name for p in ports.get(node, ()) if p.name not in used and prim[p.name] == p.name]
    return free[0] if free else "a free CX7 port"


def _judge(c: Cabling, nodes: Sequence[str], ports: Mapping[str, Sequence[Port]], group: Sequence[str]) -> None:
    """What must move for the TP group `group` to run over the cables (c.moves; empty: it can)."""
    if len(group) < 2:
        return
    links = _node_links(c)
    for n in group:
        if n not in links:
            other = next((m for m in group if m != n), "")
            c.moves.append(f"{n} has no cabled CX7 port: cable {n}:{_free(n, ports, c)} to "
                           f"{other}:{_free(other, ports, c)} (or to the switch the others use)")
    if c.moves:
        return
    if c.layout == "switch" or (c.layout == "mixed" and any(
            set(group) <= {n for n, _ in s.ends} for s in c.segments if not s.is_cable)):
        return
    if not _connected(list(group), links):
        c.moves.append(f"the cables do not join {', '.join(group)}: each rank needs a cable to the next "
                       f"({' -> '.join(group)} -> {group[0]})")
        return
    ring = list(group)
    pairs = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))] if len(ring) > 2 else [(ring[0], ring[1])]
    missing = [(a, b) for a, b in pairs if b not in links.get(a, set())]
    if not missing:
        extra = [s for s in c.segments if s.is_cable and {s.ends[0][0], s.ends[1][0]} <= set(group)
                 and (s.ends[0][0], s.ends[1][0]) not in pairs and (s.ends[1][0], s.ends[0][0]) not in pairs]
        if extra:
            c.notes.append("cables between ranks that are not neighbours carry no ring traffic: "
                           + "; ".join(s.describe() for s in extra))
        return
    crossed = [s for s in c.segments if s.is_cable and {s.ends[0][0], s.ends[1][0]} <= set(group)
               and (s.ends[0][0], s.ends[1][0]) not in pairs and (s.ends[1][0], s.ends[0][0]) not in pairs]
    walk = _ring_order(group[0], links) if c.layout == "ring" else None
    if walk and set(walk) == set(group):
        c.moves.append(f"the cables are crossed for NODES' order: they run {' -> '.join(walk)} -> {walk[0]}; "
                       f"set NODES='{' '.join(walk)}' (ranks in cable order), or re-cable "
                       + "; ".join(f"{s.describe()} (ranks that are not neighbours)" for s in crossed))
        return
    for a, b in missing:
        c.moves.append(f"cable {a}:{_free(a, ports, c)} to {b}:{_free(b, ports, c)} "
                       f"(ranks {group.index(a)} and {group.index(b)} are neighbours in the ring)")


def _ring_order(start: str, links: Mapping[str, set[str]]) -> list[str]:
    walk, prev = [start], None
    while True:
        nxt = sorted(links.get(walk[-1], set()) - {prev} if prev else links.get(walk[-1], set()))
        if not nxt or nxt[0] == start:
            return walk
        prev = walk[-1]
        if nxt[0] in walk:
            return walk
        walk.append(nxt[0])


def judge_speeds(measured: Mapping[str, float | str], floor_gbit: float) -> list[str]:
    """Per cable (its description -> Gbit/s, or why it was not measured): a warning for each cable below the
    floor (0: none) or not measured, naming both ends and what to try. A slow cable is a warning, never a failure."""
    out = []
    for cable, got in measured.items():
        if isinstance(got, str):
            out.append(f"cable {cable}: not measured ({got})")
        elif floor_gbit and got < floor_gbit:
            out.append(f"cable {cable}: {got:.1f} Gbit/s, below the recipe's floor of {floor_gbit:.0f} Gbit/s: reseat "
                       "both ends, check that `ethtool PORT` says 200000Mb/s on both nodes, or try another cable")
    return out
