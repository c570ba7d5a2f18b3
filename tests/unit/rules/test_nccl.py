"""The NCCL_DEBUG=INFO parser and its findings, on real NCCL output (tests/fixtures/nccl/README.md)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkctl.rules import nccl
from sparkctl.rules.check_rules import FAIL, OK, WARN

FIX = Path(__file__).resolve().parent.parent.parent / "fixtures" / "nccl"


def read(name: str) -> str:
    return (FIX / name).read_text()


def by_rank(log: nccl.NcclLog) -> dict[int | None, nccl.RankLog]:
    return {r.rank: r for r in log.ranks}


def test_p2p_inside_a_host_two_gpus() -> None:
    log = nccl.parse(read("nccl-default.log"))
    ranks = by_rank(log)
    assert sorted(ranks, key=str) == [0, 1]
    for r in ranks.values():
        assert r.version == "2.28.9+cuda13.0"
        assert r.nranks == 2
        assert r.transports == {"P2P": 24}  # 24 channels, each "via P2P/CUMEM" on its receive side
        assert r.net_transport is None  # the Socket plugin was assigned but no channel used a network
        assert r.ib_missing and r.network == "Socket"
        assert r.socket_ifaces == ["eth0:192.0.2.2<0>"]
        assert r.bootstrap_iface == "eth0"
    assert all(f.status == OK for f in nccl.report(log))


def test_network_path_forced_onto_sockets() -> None:
    log = nccl.parse(read("nccl-socket.log"))
    ranks = by_rank(log)
    assert ranks[0].pid == 693 and ranks[1].pid == 694
    for r in ranks.values():
        assert r.transports == {"NET/Socket": 4}
        assert {c.direction for c in r.channels} == {"send", "receive"}
        assert r.net_transport == "NET/Socket"
        assert r.env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert r.env["NCCL_IB_DISABLE"] == "1"  # "set by environment to 1." without the full stop
    # IB disabled on purpose, no NCCL_IB_HCA: sockets are what was asked for, not a finding
    assert [f.status for f in nccl.report(log)] == [OK, OK]
    # ...unless the cluster expects RDMA (a multi-node fabric check does)
    fails = [f for f in nccl.report(log, expect_rdma=True) if f.status == FAIL]
    assert len(fails) == 2 and all("fell back to NET/Socket" in f.text for f in fails)


def test_rdma_asked_with_ib_hca_but_sockets_used_fails() -> None:
    log = nccl.parse(read("h200x1-nccl-1rank-socket.log"))
    (r,) = log.ranks
    assert r.env["NCCL_IB_HCA"] == "mlx5_0"  # NCCL prints "NCCL_IB_HCA set to mlx5_0"
    assert r.ib_missing and r.network == "Socket" and r.rdma_asked
    fails = [f for f in nccl.report(log) if f.status == FAIL]
    assert len(fails) == 1
    assert "NCCL_IB_HCA=mlx5_0" in fails[0].text and "NET/Socket" in fails[0].text
    assert "ibv_devices" in fails[0].fix


def test_ib_hca_with_ib_disabled_is_not_a_fallback() -> None:
    text = read("h200x1-nccl-1rank-socket.log").replace(
        "NCCL INFO NCCL_IB_HCA set to mlx5_0",
        "NCCL INFO NCCL_IB_HCA set to mlx5_0\nvm:741:741 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.")
    assert all(f.status != FAIL for f in nccl.report(nccl.parse(text)))


def test_nccl_warn_lines_and_program_errors() -> None:
    log = nccl.parse(read("h200x1-nccl-2rank-default.log"))
    assert len(log.ranks) == 2
    assert all(any("Duplicate GPU detected" in w for w in r.warnings) for r in log.ranks)
    errors = [e for e in log.events if e["event"] == "error"]
    assert sorted(e["rank"] for e in errors) == [0, 1]
    findings = nccl.report(log)
    assert sum(f.status == WARN for f in findings) == 2
    assert sum(f.status == FAIL and "error at init" in f.text for f in findings) == 2


def test_fabric_program_events_from_a_real_gloo_run() -> None:
    log = nccl.parse(read("h200x1-gloo-2rank.log"))
    assert log.ranks == []  # gloo prints no NCCL lines
    kinds = [(e["rank"], e["event"]) for e in log.events]
    for rank in (0, 1):
        assert [k for r, k in kinds if r == rank] == ["start", "joined", "result", "result", "result", "done"]
    results = [e for e in log.events if e["event"] == "result"]
    for e in results:  # world 2: busbw = algbw x 2(n-1)/n = algbw
        assert e["busbw_gbps"] == pytest.approx(e["algbw_gbps"])
        assert e["algbw_gbps"] == pytest.approx(e["bytes"] / (e["time_us"] * 1e-6) / 1e9, rel=1e-3)


def _interleave(a: list[str], b: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if j >= len(b) or (i < len(a) and rng.random() < 0.5):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out


@pytest.mark.parametrize("prefixes", [("[0 spark1] ", "[1 spark2] "),
                                      ("2026-12-01T00:22:11.532000000Z ", "2026-12-01T00:22:11.9Z "), ("", "")])
def test_interleaved_prefixed_ranks_keep_their_own_facts(prefixes: tuple[str, str]) -> None:
    lines = read("nccl-socket.log").splitlines()
    r0 = [prefixes[0] + ln for ln in lines if ":693:" in ln]
    r1 = [prefixes[1] + ln for ln in lines if ":694:" in ln]
    log = nccl.parse("\n".join(_interleave(r0, r1, 7)))
    ranks = by_rank(log)
    assert sorted(ranks, key=str) == [0, 1]
    assert ranks[0].transports == ranks[1].transports == {"NET/Socket": 4}
    assert {c.src for c in ranks[0].channels if c.direction == "send"} == {0}
    assert {c.src for c in ranks[1].channels if c.direction == "send"} == {1}


def test_same_pid_in_two_containers_is_two_ranks_when_prefixed() -> None:
    """Containers have their own PID namespace: two ranks can both be pid 7 on host `vm`."""
    lines = [ln for ln in read("nccl-socket.log").splitlines() if ":693:" in ln]
    other = [ln.replace("rank 0 nranks", "rank 1 nranks").replace("rank 0 nRanks", "rank 1 nRanks")
             for ln in lines]
    log = nccl.parse("\n".join(_interleave(["[0 spark1] " + x for x in lines], ["[1 spark2] " + x for x in other], 3)))
    assert sorted(r.rank for r in log.ranks if r.rank is not None) == [0, 1]
    assert {r.source for r in log.ranks} == {"[0 spark1]", "[1 spark2]"}


def test_versions_that_differ_across_ranks_fail() -> None:
    text = read("nccl-socket.log").replace("vm:694:694 [1] NCCL INFO NCCL version 2.28.9+cuda13.0",
                                           "vm:694:694 [1] NCCL INFO NCCL version 2.27.3+cuda12.9")
    fails = [f for f in nccl.report(nccl.parse(text)) if f.status == FAIL]
    assert len(fails) == 1 and "2.27.3" in fails[0].text and "2.28.9" in fails[0].text
    # the +cudaX.Y build suffix alone is not a version difference
    same = read("nccl-socket.log").replace("vm:694:694 [1] NCCL INFO NCCL version 2.28.9+cuda13.0",
                                           "vm:694:694 [1] NCCL INFO NCCL version 2.28.9+cuda12.9")
    assert not [f for f in nccl.report(nccl.parse(same)) if f.status == FAIL]


def _result(rank: int, nbytes: int, busbw: float) -> str:
    doc = {"event": "result", "rank": rank, "bytes": nbytes, "busbw_gbps": busbw}
    return nccl.FABRIC_MARK + json.dumps(doc)


def test_busbw_floor_uses_the_largest_size_and_the_slowest_rank() -> None:
    text = "\n".join([_result(0, 1 << 20, 0.5), _result(0, 256 << 20, 9.0), _result(1, 256 << 20, 4.0)])
    log = nccl.parse(text)
    assert not nccl.report(log, floor_gbps=3.0)
    fails = nccl.report(log, floor_gbps=5.0)
    assert [f.status for f in fails] == [FAIL] and "4 GB/s" in fails[0].text  # rank 1, not rank 0's 9
    assert not nccl.report(log, floor_gbps=None)


def test_an_ib_run_reports_device_and_gid() -> None:
    """Shapes of NCCL's RoCE lines (2.19+), on top of a real socket log's ranks."""
    lines = read("nccl-socket.log").replace("NET/Socket/0", "NET/IB/0/GDRDMA").replace(
        "Using network Socket", "Using network IB").splitlines()
    lines.insert(5, "vm:693:693 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [RO]; OOB eth0:192.0.2.2<0>")
    lines.insert(6, "vm:693:700 [0] NCCL INFO NET/IB: NCCL Dev 0 IbDev 0 Port 1 qpn 1234 mtu 5 GID 3 (0/A0000FFFF)")
    log = nccl.parse("\n".join(lines))
    r0 = by_rank(log)[0]
    assert r0.net_transport == "NET/IB" and r0.ib_devices == ["mlx5_0:1/RoCE"] and r0.gids == {3}
    assert "NET/IB on mlx5_0:1/RoCE GID 3" in nccl.describe(r0)
    assert all(f.status == OK for f in nccl.report(log, expect_rdma=True))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.one_of(
    st.text(max_size=200),
    st.sampled_from(read("nccl-socket.log").splitlines()[:60]),
    st.builds(lambda s: nccl.FABRIC_MARK + s, st.text(max_size=60)),
    st.builds(lambda s: "h:1:1 [0] NCCL INFO " + s, st.text(max_size=80)),
), max_size=40))
def test_parse_never_raises(lines: list[str]) -> None:
    log = nccl.parse("\n".join(lines))
    nccl.report(log, expect_rdma=True, floor_gbps=1.0)
    for r in log.ranks:
        json.dumps(r.to_dict())


PATTERNS = {name: rx for name, rx in vars(nccl).items() if isinstance(rx, re.Pattern)}


class _Spy:
    """A compiled pattern that records the length of every string it is asked to scan."""

    def __init__(self, rx: re.Pattern[str], seen: list[int]) -> None:
        self.rx, self.seen = rx, seen

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.rx, name)

        def spied(*args: Any, **kw: Any) -> Any:
            self.seen.extend(len(a) for a in args if isinstance(a, str))
            return fn(*args, **kw)
        return spied


def test_no_regex_scans_more_than_max_line_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mechanism that keeps a pathological log cheap, without a stopwatch (the wall-clock figure
    is bench/suite_timings.py's): every line is cut to MAX_LINE before any pattern sees it, so with
    the patterns' shape (next test) a line costs a bounded amount of matching however long it is."""
    seen: list[int] = []
    for name, rx in PATTERNS.items():
        monkeypatch.setattr(nccl, name, _Spy(rx, seen))
    hostile = ["a:1:1 [0] " * 20000 + "NCCL INFO x",  # NCCL's words only past the cut
               "h:1:1 [0] NCCL INFO " + "NET/IB : Using " + "[0]x:" * 5000,
               "h:1:1 [0] NCCL INFO NCCL_IB_HCA set to " + "=" * 50000,
               "2024-01-01T00:00:00Z " * 3000 + "h:1:1 [0] NCCL INFO x",
               nccl.FABRIC_MARK + "{" * 40000]
    log = nccl.parse("\n".join(hostile * 4))
    assert seen and max(seen) <= nccl.MAX_LINE
    assert log.lines == 20 and log.events == []
    assert {r.host for r in log.ranks} == {"h"}  # the first and fourth lines' NCCL words lie past the cut


def _unbounded_repeats(tree: Any, inside: bool = False) -> int:
    """How deep unbounded repeats (*, +, {n,}) nest in a parsed pattern (re._parser's tree)."""
    import re._parser as sre  # noqa: PLC0415 - CPython's own pattern parser

    depth = 0
    for op, arg in tree:
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            lo, hi, sub = arg
            unbounded = hi is sre.MAXREPEAT or hi > 4096
            d = _unbounded_repeats(sub, inside or unbounded)
            depth = max(depth, d + 1 if unbounded else d)
        elif op in (sre.SUBPATTERN, sre.ATOMIC_GROUP):
            depth = max(depth, _unbounded_repeats(arg[-1] if op is sre.SUBPATTERN else arg, inside))
        elif op is sre.BRANCH:
            depth = max(depth, *(_unbounded_repeats(b, inside) for b in arg[1]))
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            depth = max(depth, _unbounded_repeats(arg[1], inside))
    return depth


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_no_pattern_nests_an_unbounded_repeat(name: str) -> None:
    """Star height 1 at most: no (x+)+-style nesting, the shape that backtracks exponentially."""
    import re._parser as sre  # noqa: PLC0415

    assert _unbounded_repeats(sre.parse(PATTERNS[name].pattern)) <= 1, PATTERNS[name].pattern


def test_the_nesting_check_sees_nesting() -> None:
    import re._parser as sre  # noqa: PLC0415

    assert _unbounded_repeats(sre.parse(r"^(a+)+$")) == 2
    assert _unbounded_repeats(sre.parse(r"(?:x|(?:ab*)*)c")) == 2
    assert _unbounded_repeats(sre.parse(r"a{1,200}(b*)c")) == 1


# ------------------------------------------------------------------------------ the command


def test_nccl_report_exit_codes_on_real_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sparkctl.cli import main

    def _cli(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        out = capsys.readouterr()
        return int(exc.value.code or 0), out.out + out.err

    assert _cli("nccl-report", str(FIX / "nccl-default.log"))[0] == 0
    code, text = _cli("nccl-report", str(FIX / "h200x1-nccl-1rank-socket.log"))
    assert code == 1 and "fell back to NET/Socket" in text
    assert _cli("nccl-report", "--expect-rdma", str(FIX / "nccl-socket.log"))[0] == 1
    code, _ = _cli("--json", "nccl-report", str(FIX / "nccl-socket.log"))
    assert code == 0
    with pytest.raises(SystemExit):
        main(["--json", "nccl-report", str(FIX / "nccl-socket.log")])
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and [r["transports"] for r in doc["ranks"]] == [{"NET/Socket": 4}] * 2
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    assert _cli("nccl-report", str(empty))[0] == 2
    assert _cli("nccl-report", str(tmp_path / "missing.log"))[0] == 2
