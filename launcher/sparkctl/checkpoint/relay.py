"""The chain of `model sync`: the source sends the checkpoint once, to the first rank, and each rank forwards
what it has received to the next while it receives the rest (source -> r1 -> r2 -> r3, pipelined by file).

Why a chain (docs/model.md has the measurements): a star (one rsync per rank from the source) reads the
source's disk once per rank -- a checkpoint bigger than the page cache is read three times for three ranks --
and puts every copy on the source's one link and its CPU's ciphers. In the chain every byte leaves the source
once and crosses each rank's link once in and once out; the hops run at once, so the wall time is one hop's
plus the time of one batch per extra hop.

`Relay` is the schedule, shared by every hop's workers (threads): a hop takes a batch of the files its
receiver needs that its sender already holds (the source holds everything; a rank holds what it had before
the sync and what has arrived): the small files first, then the shards in the source's order, up to
`BATCH_BYTES` a batch (a larger file alone) so that the hops follow each other shard by shard. A batch that fails makes its
receiver broken (it ends resumable with the reason; a re-run resumes from the fingerprints), and the hop
after it reroutes to the nearest sender upstream that is not broken: a rank lost midway costs the ranks
after it a detour, not their copy. Every sender's key is on every rank after it for that reason.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SMALL_FILE = 64 * 1024 * 1024  # files below this (configs, tokenizer, serving/) go first, together
# A batch is one rsync (one ssh login and two rsync processes: about 0.3 CPU-s on the lab's hosts): files in
# order up to this many bytes, a larger file alone. 1 GiB measured fastest on the lab (docs/measured.md); on real
# links a hop moves it in well under a second, so the hops still follow each other closely.
BATCH_BYTES = 1024 * 1024 * 1024
STREAMS = 2  # rsyncs at once per hop: one core's cipher is not the limit of a hop


@dataclass
class Hop:
    sender: str
    receiver: str
    todo: list[str]  # the receiver's files not yet taken, in the source's order
    senders: list[str] = field(default_factory=list)  # every node it sent from, the first its place in the chain

    def __post_init__(self) -> None:
        self.senders = self.senders or [self.sender]


class Relay:
    """Which files each hop of the chain may send now. Thread-safe; `take` blocks until a batch is ready."""

    def __init__(self, chain: Sequence[str], need: Mapping[str, Sequence[str]], sizes: Mapping[str, int],
                 *, batch_bytes: int = BATCH_BYTES, small: int = SMALL_FILE) -> None:
        if len(chain) < 2:
            raise ValueError("a chain needs the source and at least one rank")
        self.chain = list(chain)
        self.sizes = dict(sizes)
        self.batch_bytes = batch_bytes
        # the small files first (they travel together, and every hop forwards them at once), then the large
        # ones in the source's order: the hops follow each other file by file
        first = {r: sorted(need.get(r, ()), key=lambda n: self.sizes.get(n, 0) >= small) for r in self.chain[1:]}
        self.hops = {r: Hop(s, r, first[r]) for s, r in zip(self.chain, self.chain[1:], strict=False)}
        # the files a node will hold once they arrive (all it needs; the source needs none)
        self.pending: dict[str, set[str]] = {n: set(need.get(n, ())) for n in self.chain[1:]}
        self.pending[self.chain[0]] = set()
        self.broken: dict[str, str] = {}
        self.cond = threading.Condition()

    # ------------------------------------------------------------------------------------------ hops
    def _ready(self, hop: Hop) -> list[str]:
        """A batch the hop may send now (under the lock), [] when nothing is ready yet."""
        sender_waits = self.pending[hop.sender]
        batch: list[str] = []
        total = 0
        for name in hop.todo:
            if name in sender_waits:
                continue  # not at the sender yet
            size = self.sizes.get(name, 0)
            if batch and total + size > self.batch_bytes:
                break
            batch.append(name)
            total += size
        for name in batch:
            hop.todo.remove(name)
        return batch

    def _reroute(self, hop: Hop) -> None:
        """A hop whose sender broke takes the nearest sender upstream that did not (the source never does), so
        one lost rank costs the ranks after it nothing but the detour (under the lock)."""
        sender = hop.sender
        while sender in self.broken:
            sender = self.chain[self.chain.index(sender) - 1]
        if sender != hop.sender:
            hop.sender = sender
            hop.senders.append(sender)

    def take(self, receiver: str, timeout: float) -> tuple[str, list[str]] | None:
        """The next batch for the hop into `receiver` and the node to send it from; (sender, []) when none is
        ready within `timeout` (ask again); None when the hop has nothing more to send or its receiver broke."""
        hop = self.hops[receiver]
        with self.cond:
            waited = False
            while True:
                if receiver in self.broken:
                    return None
                self._reroute(hop)
                if not hop.todo:
                    return None
                batch = self._ready(hop)
                if batch or waited:
                    return hop.sender, batch
                self.cond.wait(timeout)
                waited = True

    def arrived(self, receiver: str, files: Sequence[str]) -> None:
        with self.cond:
            self.pending[receiver].difference_update(files)
            self.cond.notify_all()

    def failed(self, receiver: str, sender: str, files: Sequence[str], reason: str, *, sender_lost: bool = False) -> None:
        """A batch did not arrive. When its sender is lost (or broke meanwhile) and is not the source, the
        sender breaks and the batch goes back to the hop, to come from upstream; else the receiver breaks: it
        takes no more work, and the hops after it reroute."""
        with self.cond:
            hop = self.hops[receiver]
            if sender_lost and sender != self.chain[0]:
                self.broken.setdefault(sender, reason)
            if sender in self.broken and receiver not in self.broken:
                hop.todo[:0] = [f for f in files if f not in hop.todo]
            else:
                self.broken.setdefault(receiver, reason)
            self.cond.notify_all()

    def complete(self, receiver: str) -> bool:
        """Every file it needed has arrived (a rank lost after that still holds them)."""
        with self.cond:
            return not self.pending[receiver]

    def why(self, receiver: str) -> str:
        with self.cond:
            return self.broken.get(receiver, "")


def chain_order(source: str, ranks: Sequence[str]) -> list[str]:
    """The chain: the source, then the ranks that need files, in NODES order (on a switch every order is as
    good; NODES is the one the user reads)."""
    return [source, *ranks]
