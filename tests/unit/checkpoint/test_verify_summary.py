"""The one checkpoint reader's summaries: what the head sends instead of 232k tensor entries.

Held to the full-header path (the per-tensor reading every earlier verdict came from): the same
findings and summary on every pack and every fault, the fast path taking the sound packs and the
rule-level faults, the full headers taking every structural fault; summaries lossless; the cache
re-reading exactly what changed; the probe bundled with the header parser and runnable alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkctl.checkpoint.safetensors import DTYPE_BITS, TensorKind, nbytes, read_header
from sparkctl.checkpoint.verify import NeedHeaders, Report, verify_scan
from sparkctl.lab import ckptgen
from sparkctl.probes import ckpt_scan
from sparkctl.spec.recipes import load_layout
from sparkctl.spec.resources import probe_script

TINY = load_layout("tiny")
Fault = Callable[[Path], Any]


def key(report: Report) -> tuple[bool, Counter[tuple[str, str, str]], dict[str, Any]]:
    return (report.ok, Counter((f.severity, f.code, f.where) for f in report.findings), report.summary.to_dict())


def both(d: Path, layout: dict[str, Any] | None) -> tuple[Report, Report | None]:
    """(the full-header verdict, the summary verdict or None when the summary deferred to the headers)."""
    full = verify_scan(ckpt_scan.scan(str(d), headers="raw"), layout)
    doc = json.loads(json.dumps(ckpt_scan.scan(str(d), headers="summary", summary_cache="")))  # as over SSH
    try:
        return full, verify_scan(doc, layout)
    except NeedHeaders:
        return full, None


def _config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _rename_in_index(d: Path, old: str, new: str) -> None:
    """The index names `new` where the shard holds `old`: the same count per shard, other names."""
    doc = json.loads((d / ckptgen.INDEX).read_text())
    doc["weight_map"][new] = doc["weight_map"].pop(old)
    (d / ckptgen.INDEX).write_text(json.dumps(doc))


# fault, whether the summary decides it (True) or must defer to the full headers (False)
CASES: list[tuple[str, Fault, bool]] = [
    ("sound", lambda d: None, True),
    ("truncated", lambda d: ckptgen.truncate_shard(d, 1, 100), True),
    ("bits 7 on layer 4", lambda d: ckptgen.set_expert_bits(d, 7, layer=4), True),
    ("quantized mtp", ckptgen.quantize_mtp, True),
    ("config differs", lambda d: _config(d, num_hidden_layers=7), False),  # expert count then differs too
    ("hidden size", lambda d: _config(d, hidden_size=123), True),
    ("extra shard", lambda d: (d / "model-extra.safetensors").write_bytes(
        (d / "model-00001-of-00003.safetensors").read_bytes()), True),
    ("shard missing", lambda d: ckptgen.remove_shard(d, 2), False),
    ("retargeted", lambda d: ckptgen.retarget_tensor(d, "model.norm.weight"), False),
    ("overlap", lambda d: ckptgen.overlap_offsets(d, 2), False),
    ("past eof", lambda d: ckptgen.header_past_eof(d, 3), False),
    ("garbage", lambda d: ckptgen.garbage_header(d, 1), False),
    ("marker dropped", ckptgen.drop_marker, False),
    ("marker added", ckptgen.add_marker, False),
    ("no index", lambda d: (d / ckptgen.INDEX).unlink(), False),
    ("one expert's suh dropped", lambda d: ckptgen.transform_tensors(
        d, lambda n, t, s: [] if n == "model.layers.4.mlp.experts.2.down_proj.suh" else None), False),
    ("an svh of no linear", lambda d: ckptgen.transform_tensors(
        d, lambda n, t, s: [(n, t, s), ("model.layers.4.mlp.experts.1.foo_proj.svh", t, s)]
        if n == "model.layers.4.mlp.experts.1.up_proj.svh" else None), False),
    ("a suh moved to another expert", lambda d: ckptgen.transform_tensors(
        d, lambda n, t, s: [(n.replace("experts.2.", "experts.99."), t, s)]
        if n == "model.layers.4.mlp.experts.2.down_proj.suh" else None), False),
    ("the index renames a tensor", lambda d: _rename_in_index(d, "model.norm.weight", "model.norm.bias"), False),
    ("a trellis turned native", lambda d: ckptgen.transform_tensors(
        d, lambda n, t, s: [(n, t, s), (n.replace(".trellis", ".weight"), "BF16", (4, 4))]
        if n == "model.layers.5.mlp.experts.0.gate_proj.trellis" else None), False),
    ("config garbage", lambda d: (d / "config.json").write_text("{not json"), True),
]


@pytest.mark.parametrize(("fault", "decides"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_summary_verdict_is_the_full_header_verdict(tmp_path: Path, fault: Fault, decides: bool) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    fault(d)
    full, fast = both(d, TINY)
    assert (fast is not None) == decides, (full.findings, fast and fast.findings)
    if fast is not None:
        assert key(fast) == key(full)
    else:  # what the summary could not decide is a real problem the headers name
        assert [f for f in full.findings if f.severity in ("error", "warn") and f.code != "codebook-mixed"]


@pytest.mark.parametrize(("pack", "layout"), [("3.00bpw", "glm53-3.00bpw"), ("2.75bpw", "glm53-2.75bpw"),
                                              ("4bit", "glm53-3.00bpw")])
def test_full_size_packs_are_decided_from_their_summaries(tmp_path: Path, pack: str, layout: str) -> None:
    d = ckptgen.make_checkpoint(tmp_path / pack, pack, serving=False)
    full, fast = both(d, load_layout(layout))
    assert fast is not None and key(fast) == key(full)
    if pack == "2.75bpw":  # its optional 6-bit head is decided from its summary too
        assert fast.summary.optional_files == full.summary.optional_files != []


def test_a_changed_expert_shape_defers_to_the_headers(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    n = ckptgen.transform_tensors(d, lambda name, dtype, shape: [(name, dtype, (shape[0] + 1, *shape[1:]))]
                                  if name == "model.layers.4.mlp.experts.1.up_proj.suh" else None)
    assert n == 1
    full, fast = both(d, TINY)
    assert fast is None and "exl3-scales" in {f.code for f in full.findings}


def expand(groups: list[list[Any]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for pre, tail, dtype, shape, ids in groups:
        if ids is None:
            out[pre] = (dtype, tuple(shape))
        else:
            for a, b in ids:
                out.update({f"{pre}{i}.{tail}": (dtype, tuple(shape)) for i in range(a, b + 1)})
    return out


def test_summaries_are_lossless_on_a_full_size_shard(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "p", "3.00bpw", serving=False)
    n_groups = n_tensors = 0
    for shard in ckptgen.shards(d)[::10]:
        kinds = read_header(shard).kinds
        groups = ckpt_scan.summarize_kinds(kinds)
        assert expand(groups) == {n: (k.dtype, k.shape) for n, k in kinds.items()}
        n_groups, n_tensors = n_groups + len(groups), n_tensors + len(kinds)
    assert n_groups < n_tensors / 40


NAME = st.lists(st.sampled_from([*"ab.0179\n\x00", ".experts.", "experts", ".experts.1."]), max_size=8).map("".join)


@given(st.dictionaries(NAME, st.sampled_from(["F16", "I16"]), max_size=12))
def test_summaries_are_lossless_for_any_names(names: dict[str, str]) -> None:
    kinds = {n: TensorKind(d, (2,), nbytes(d, (2,))) for n, d in names.items()}
    groups = ckpt_scan.summarize_kinds(kinds)
    assert expand(groups) == {n: (k.dtype, k.shape) for n, k in kinds.items()}
    assert groups == ckpt_scan._summarize_slow(kinds)  # the bulk path and the per-name path agree
    assert all(g[2] in DTYPE_BITS for g in groups)


def test_the_cache_rereads_exactly_what_changed(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    cache = str(tmp_path / "cache.json")
    first = ckpt_scan.scan(str(d), headers="summary", summary_cache=cache)
    assert first["cache_hits"] == 0
    again = ckpt_scan.scan(str(d), headers="summary", summary_cache=cache)
    assert again["cache_hits"] == 3 + 1  # every shard and the index, none read
    assert again["shards"] == first["shards"] and again["json"] == first["json"]
    ckptgen.set_expert_bits(d, 4, layer=4)  # rewrites the shards holding layer 4
    third = ckpt_scan.scan(str(d), headers="summary", summary_cache=cache)
    changed = [n for n in first["shards"] if first["shards"][n] != third["shards"][n]]
    index_changed = first["json"][ckptgen.INDEX] != third["json"][ckptgen.INDEX]
    assert changed and third["cache_hits"] == 4 - len(changed) - index_changed
    # same size and mtime, other bytes (a copy put back with its old times): the inode/ctime give it away
    shard = ckptgen.shards(d)[0]
    st0 = shard.stat()
    data = bytearray(shard.read_bytes())
    data[9] ^= 1  # inside the header
    tmp = shard.with_suffix(".new")
    tmp.write_bytes(bytes(data))
    os.utime(tmp, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    tmp.replace(shard)
    fourth = ckpt_scan.scan(str(d), headers="summary", summary_cache=cache)
    assert fourth["shards"][shard.name] != third["shards"][shard.name]


def test_the_bundled_probe_runs_alone_and_summarises(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    empty = tmp_path / "cwd"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-I", "-", str(d), "--headers", "summary", "--summary-cache", ""],
                         input=probe_script("ckpt_scan.py"), capture_output=True, cwd=empty, timeout=60,
                         env={"PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr.decode()
    doc = json.loads(out.stdout)
    local = ckpt_scan.scan(str(d), headers="summary", summary_cache="")
    assert doc["shards"] == json.loads(json.dumps(local["shards"]))
    assert b"def parse_header" in probe_script("ckpt_scan.py")  # the parser travels with it


def test_a_probe_may_not_take_other_sparkctl_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkctl.spec import resources

    probe = tmp_path / "probes" / "bad.py"
    probe.parent.mkdir()
    probe.write_text("from sparkctl.cluster import Cluster\n")
    monkeypatch.setattr(resources, "_PKG", tmp_path)
    with pytest.raises(RuntimeError, match="not a probe module"):
        resources.probe_script("bad.py")


_REAL_SUMMARIZE = ckpt_scan._summarize_uncached


def _recording_summarize(*args: Any) -> Any:
    """The workers' job, noting which process ran it (in a file: a worker's memory is its own)."""
    with open(os.environ["SPARKCTL_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return _REAL_SUMMARIZE(*args)


def test_worker_processes_give_the_same_scan_and_fill_the_cache(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold scan summarises its shards in worker processes (fork): the same document as one process,
    and the parent's cache holds what the workers read (the next scan reads nothing)."""
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    serial = ckpt_scan.scan(str(d), headers="summary", fingerprints=True, summary_cache="")
    pids = tmp_path / "pids"
    monkeypatch.setenv("SPARKCTL_TEST_PIDS", str(pids))
    monkeypatch.setattr(ckpt_scan, "_summarize_uncached", _recording_summarize)  # fork: the workers see it
    monkeypatch.setattr(ckpt_scan._Summarizers, "MIN_SHARDS", 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    # The pool is used only when the caller is the process's one thread (a probe on a node is); a
    # thread an earlier test left running (seen in a random-order run) must not turn this test into a
    # serial scan that writes no pids. The workers here only read files, so the fork is safe.
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    cache = str(tmp_path / "cache.json")
    pooled = ckpt_scan.scan(str(d), headers="summary", fingerprints=True, summary_cache=cache)
    assert pooled["shards"] == serial["shards"] and pooled["json"] == serial["json"]
    assert pooled["cache_hits"] == 0
    workers = set(pids.read_text().split())
    assert len(pids.read_text().split()) == 3 and str(os.getpid()) not in workers  # 3 shards, not here
    again = ckpt_scan.scan(str(d), headers="summary", fingerprints=True, summary_cache=cache)
    assert again["cache_hits"] == 3 * 2 + 1 and again["shards"] == serial["shards"]  # header + fingerprints


def test_the_cache_forgets_files_that_are_gone_and_stays_bounded(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cache = str(tmp_path / "cache.json")
    a = ckptgen.make_checkpoint(tmp_path / "a")
    b = ckptgen.make_checkpoint(tmp_path / "b")
    ckpt_scan.scan(str(a), headers="summary", summary_cache=cache)
    ckpt_scan.scan(str(b), headers="summary", summary_cache=cache)
    assert len(json.loads(Path(cache).read_text())["files"]) == 8  # 3 shards + the index, twice
    import shutil

    shutil.rmtree(a)
    ckpt_scan.scan(str(b), headers="summary", summary_cache=cache)  # nothing new: nothing to save
    ckptgen.set_expert_bits(b, 4, layer=4)
    ckpt_scan.scan(str(b), headers="summary", summary_cache=cache)
    kept = json.loads(Path(cache).read_text())["files"]
    assert kept and all(str(b) in p for p in kept)  # a's entries went with a
    monkeypatch.setattr(ckpt_scan.SummaryCache, "LIMIT", 2)
    ckpt_scan.scan(str(ckptgen.make_checkpoint(tmp_path / "c")), headers="summary", summary_cache=cache)
    assert len(json.loads(Path(cache).read_text())["files"]) == 2


def test_workers_end_by_themselves_never_by_a_signal(tmp_path: Path) -> None:
    """Pool.terminate() kills workers wherever they are, one of them perhaps holding the task queue's
    lock, and join() then waits for ever (the unit suite once hung so): the scan never calls it, and
    its workers end even when the parent ignores SIGTERM (the CLI has its own handlers)."""
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    code = (
        "import os, signal, multiprocessing.pool\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "multiprocessing.pool.Pool.terminate = lambda self: os._exit(3)\n"
        "from sparkctl.probes import ckpt_scan\n"
        "ckpt_scan._Summarizers.MIN_SHARDS = 1\n"
        "os.sched_getaffinity = lambda pid: {0, 1}\n"
        f"doc = ckpt_scan.scan({str(d)!r}, headers='summary', summary_cache='')\n"
        "print(len(doc['shards']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "3", (r.returncode, r.stderr)


_JUNK = st.none() | st.booleans() | st.integers(-3, 10**12) | st.text(max_size=6) | st.lists(st.integers(), max_size=3)


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = ckptgen.make_checkpoint(tmp_path_factory.mktemp("sound") / "tiny")
    return json.loads(json.dumps(ckpt_scan.scan(str(d), headers="summary", summary_cache="")))


@given(data=st.data())
def test_a_malformed_summary_only_ever_asks_for_the_headers(sound: dict[str, Any], data: st.DataObject) -> None:
    """What a node prints is untrusted: any damage to a summary scan ends in NeedHeaders (the full
    headers then decide) or a verdict, never another exception."""
    doc = json.loads(json.dumps(sound))
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.sampled_from(["index", "shard", "group", "config"]))
        if where == "index":
            doc["json"][ckptgen.INDEX]["summary"][data.draw(st.sampled_from(
                ["shards", "tensors", "weight_map", "total_size"]))] = data.draw(_JUNK)
        elif where == "shard":
            name = data.draw(st.sampled_from(sorted(doc["shards"])))
            doc["shards"][name][data.draw(st.sampled_from(["summary", "size", "header_len"]))] = data.draw(_JUNK)
        elif where == "group":
            name = data.draw(st.sampled_from(sorted(doc["shards"])))
            summ = doc["shards"][name].get("summary")
            if isinstance(summ, dict) and isinstance(summ.get("groups"), list) and summ["groups"]:
                g = summ["groups"][data.draw(st.integers(0, len(summ["groups"]) - 1))]
                g[data.draw(st.integers(0, 4))] = data.draw(_JUNK)
        else:
            doc["json"]["config.json"] = data.draw(_JUNK | st.just({"data": "!!"}))
    try:
        verify_scan(doc, TINY)
    except NeedHeaders:
        pass
