"""The chain's schedule: a hop sends only what its sender already holds, every file crosses every hop once,
the source sends only to the first rank, large files go alone and small ones together, a rank that already
had a file forwards it at once, and a hop that fails leaves the ranks after it resumable with the reason."""

from __future__ import annotations

import random
import threading
import time

from sparkctl.checkpoint.relay import Relay

MB = 1024 * 1024
SHARDS = [f"model-{i:05d}.safetensors" for i in range(6)]
SMALL = ["config.json", "tokenizer.json", "tokenizer_config.json"]
SIZES = {**{s: 500 * MB for s in SHARDS}, **{s: 10_000 for s in SMALL}}
FILES = sorted(SHARDS + SMALL)


def drive(relay: Relay, order: list[str]) -> list[tuple[str, str, list[str]]]:
    """Run the hops one batch at a time, visiting the receivers in `order`, each batch arriving at once:
    [(sender, receiver, batch)] in the order sent."""
    sent = []
    open_hops = list(order)
    for _ in range(1000):
        if not open_hops:
            return sent
        for receiver in list(open_hops):
            got = relay.take(receiver, 0.0)
            if got is None:
                open_hops.remove(receiver)
            elif got[1]:
                sent.append((got[0], receiver, got[1]))
                relay.arrived(receiver, got[1])
    raise AssertionError("the relay never finished")


def test_each_file_crosses_each_hop_once_and_only_after_it_reached_the_sender() -> None:
    chain = ["head", "r1", "r2", "r3"]
    relay = Relay(chain, {r: FILES for r in chain[1:]}, SIZES)
    sent = drive(relay, ["r3", "r2", "r1"])  # the last hop asks first: it must wait, not send what r2 lacks
    held = {"head": set(FILES), "r1": set(), "r2": set(), "r3": set()}
    for sender, receiver, batch in sent:
        assert chain.index(receiver) == chain.index(sender) + 1
        assert set(batch) <= held[sender], f"{sender} sent {batch} before it held them"
        assert not set(batch) & held[receiver], f"{receiver} got {batch} twice"
        held[receiver] |= set(batch)
    assert all(held[r] == set(FILES) for r in chain[1:])
    assert {s for s, _, _ in sent if s == "head"} == {"head"}
    assert sum(len(b) for s, _, b in sent if s == "head") == len(FILES)  # the source sends one copy
    assert all(relay.complete(r) for r in chain[1:])


def test_batches_hold_files_up_to_their_bytes_small_files_first_a_larger_file_alone() -> None:
    relay = Relay(["head", "r1"], {"r1": FILES}, SIZES, batch_bytes=1000 * MB)
    batches = [b for _, _, b in drive(relay, ["r1"])]
    assert batches[0][:3] == sorted(SMALL)  # the small files go first, together
    assert [len(b) for b in batches] == [4, 2, 2, 1]  # 3 small + one 500 MB shard, then two per 1,000 MB
    relay = Relay(["head", "r1"], {"r1": FILES}, SIZES, batch_bytes=100 * MB)
    assert [len(b) for _, _, b in drive(relay, ["r1"])] == [3, 1, 1, 1, 1, 1, 1]  # a larger file alone


def test_a_rank_that_already_holds_a_file_forwards_it_before_receiving_anything() -> None:
    have = SHARDS[3]
    relay = Relay(["head", "r1", "r2"], {"r1": [f for f in FILES if f != have], "r2": FILES}, SIZES)
    assert relay.take("r2", 0.0) == ("r1", [have])  # r1 had it before the sync: nothing to wait for
    assert relay.take("r2", 0.0) == ("r1", [])  # the rest is not at r1 yet


def test_a_rank_that_cannot_receive_ends_resumable_and_the_ranks_after_it_get_everything_from_upstream() -> None:
    chain = ["head", "r1", "r2", "r3"]
    relay = Relay(chain, {r: FILES for r in chain[1:]}, SIZES)
    sender, b = relay.take("r1", 0.0)  # type: ignore[misc]
    relay.arrived("r1", b)
    sender, got = relay.take("r1", 0.0)  # type: ignore[misc]
    relay.failed("r1", sender, got, "head -> r1: rsync exit 12: connection reset")
    assert relay.take("r1", 0.0) is None  # r1 takes no more work
    sent = drive(relay, ["r2", "r3"])
    assert {f for s, r, batch in sent if r == "r2" for f in batch} == set(FILES)
    assert {s for s, r, _ in sent if r == "r2"} == {"head"}  # a broken rank sends no more
    assert relay.hops["r2"].senders == ["r1", "head"]
    assert not relay.complete("r1") and relay.complete("r2") and relay.complete("r3")
    assert "connection reset" in relay.why("r1")
    assert relay.hops["r3"].senders == ["r2"]  # r2 was never lost: r3 stays on it


def test_a_sender_lost_midway_is_routed_around_and_its_batch_sent_again_from_upstream() -> None:
    chain = ["head", "r1", "r2", "r3"]
    relay = Relay(chain, {r: FILES for r in chain[1:]}, SIZES)
    for _ in range(3):  # r1 and r2 get the first batches; r3 asks r2 for one
        for r in ("r1", "r2"):
            s, b = relay.take(r, 0.0)  # type: ignore[misc]
            relay.arrived(r, b)
    s, b = relay.take("r3", 0.0)  # type: ignore[misc]
    assert s == "r2" and b
    relay.failed("r3", "r2", b, "r2 -> r3: SSH connection lost", sender_lost=True)
    assert "r3" not in relay.broken and "r2" in relay.broken
    sent = drive(relay, ["r3", "r2", "r1"])
    assert {f for s, r, batch in sent if r == "r3" for f in batch} == set(FILES)  # the lost batch included
    assert relay.hops["r3"].senders == ["r2", "r1"]
    assert relay.complete("r3") and relay.complete("r1")


def test_the_source_is_never_routed_around() -> None:
    relay = Relay(["head", "r1", "r2"], {"r1": FILES, "r2": FILES}, SIZES)
    s, b = relay.take("r1", 0.0)  # type: ignore[misc]
    relay.failed("r1", s, b, "head -> r1: SSH connection lost", sender_lost=True)
    assert "head" not in relay.broken and "r1" in relay.broken
    assert relay.take("r1", 0.0) is None


def test_threads_with_several_streams_per_hop_deliver_everything_in_chain_order() -> None:
    """Each hop's workers run at once (as model sync's threads do), batches taking random times."""
    chain = ["head", "r1", "r2", "r3"]
    relay = Relay(chain, {r: FILES for r in chain[1:]}, SIZES)
    rnd = random.Random(7)
    arrived_at: dict[tuple[str, str], float] = {}
    started_at: dict[tuple[str, str], float] = {}
    lock = threading.Lock()

    def worker(receiver: str) -> None:
        for _ in range(1000):
            got = relay.take(receiver, 0.05)
            if got is None:
                return
            batch = got[1]
            now = time.monotonic()
            with lock:
                for f in batch:
                    assert (receiver, f) not in started_at
                    started_at[(receiver, f)] = now
            time.sleep(rnd.uniform(0.0, 0.01))
            with lock:
                for f in batch:
                    arrived_at[(receiver, f)] = time.monotonic()
            relay.arrived(receiver, batch)

    threads = [threading.Thread(target=worker, args=(r,)) for r in chain[1:] for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert set(arrived_at) == {(r, f) for r in chain[1:] for f in FILES}
    for prev, nxt in zip(chain[1:], chain[2:], strict=False):
        for f in FILES:
            assert started_at[(nxt, f)] >= arrived_at[(prev, f)], f"{nxt} got {f} before {prev} held it"
