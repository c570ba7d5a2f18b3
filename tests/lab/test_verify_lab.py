"""`sparkctl verify-model` in cluster mode, over real SSH, against the lab's first four hosts.

Each host sees its own copy of the tiny test checkpoint at /models/lab (lab.host(n).model_dir on this
machine): the situation of a node whose "shared" folder is really a local copy (the NFS self-mount
gotcha). The good lab passes; one host with a differing shard fails, naming that host and that shard.
The tests that change a host's folder put it back exactly (same inodes, bytes and mtimes) in `finally`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sparkctl.lab import ckptgen
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
VICTIM = "spark3"
SHARD = "model-00002-of-00003.safetensors"


def verify_model(lab: Lab) -> tuple[int, dict[str, Any], str]:
    """The real CLI, `--json verify-model` without --local, against NODES: (exit code, JSON, stderr)."""
    r = subprocess.run([sys.executable, "-m", "sparkctl", "--json", "verify-model"],
                       env={**lab.env(), "NODES": " ".join(NODES), "RECIPE": "lab"},
                       capture_output=True, text=True, timeout=180)
    try:
        doc = json.loads(r.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"not one JSON document on stdout (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.returncode, doc, r.stderr


def accepted(lab: Lab) -> dict[str, int]:
    """SSH connections each host's sshd has accepted so far."""
    return {n: lab.host(n).sshd_log.read_text(errors="replace").count("Accepted publickey") for n in NODES}


def snapshot(folder: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every file under `folder`: (inode, size, mtime_ns, sha256), to prove it was put back exactly."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(folder))] = (st.st_ino, st.st_size, st.st_mtime_ns,
                                               hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@contextmanager
def shard_replaced(lab: Lab, tmp_path: Path, damage: Callable[[Path, Path], None]) -> Iterator[Path]:
    """Replace VICTIM's SHARD by damage(original, new_path); put the original back in `finally`.

    The original is moved aside on the same file system (so it comes back as the very same file)
    after a full copy of the folder is kept as a second way back.
    """
    folder = lab.host(VICTIM).model_dir
    before = snapshot(folder)
    backup = tmp_path / "backup"
    shutil.copytree(folder, backup, copy_function=shutil.copy2)
    target = folder / SHARD
    aside = folder.parent / f".{SHARD}.verify-test-original"
    os.replace(target, aside)
    try:
        damage(aside, target)
        yield target
    finally:
        target.unlink(missing_ok=True)
        if aside.exists():
            os.replace(aside, target)
        else:  # never expected: fall back to the copy
            shutil.copy2(backup / SHARD, target)
        assert snapshot(folder) == before, f"{folder} was not restored exactly (backup in {backup})"


def other_revision(tmp_path: Path) -> Callable[[Path, Path], None]:
    """The same shard of another revision of the pack: mcg everywhere (no codebook switch at layer 4)."""
    other = ckptgen.make_checkpoint(tmp_path / "other-revision", "tiny", codebook_switch_layer=None, serving=False)

    def damage(original: Path, target: Path) -> None:
        shutil.copy2(other / SHARD, target)
        assert (other / SHARD).read_bytes() != original.read_bytes()

    return damage


def truncated(original: Path, target: Path) -> None:
    """An interrupted copy: the shard is 4 KiB short."""
    data = original.read_bytes()
    target.write_bytes(data[: len(data) - 4096])


def test_good_lab_passes_with_one_connection_per_node(lab: Lab) -> None:
    before = accepted(lab)
    code, doc, stderr = verify_model(lab)
    after = accepted(lab)
    assert code == 0 and doc["ok"], (doc.get("findings"), stderr)
    assert doc["head"] == "spark1" and sorted(doc["nodes"]) == NODES
    assert all(n["shards"] == 3 for n in doc["nodes"].values())
    s = doc["summary"]
    assert (s["shards"], s["tensors"], s["quantized_by_bits"]) == (3, 446, {"3": 72})
    assert s["codebooks"] == "mcg: layer 3 · mul1: layers 4–5"
    assert not [f for f in doc["findings"] if f["code"] in ("node-differs", "node-scan-failed", "node-unreachable")]
    # One SSH connection per node: the scan ships on the connection's stdin, nothing else connects.
    assert {n: after[n] - before[n] for n in NODES} == dict.fromkeys(NODES, 1)


@pytest.mark.parametrize("fault", ["other-revision", "truncated"])
def test_a_node_with_a_differing_shard_is_named(lab: Lab, tmp_path: Path, fault: str) -> None:
    damage = other_revision(tmp_path) if fault == "other-revision" else truncated
    with shard_replaced(lab, tmp_path, damage):
        before = accepted(lab)
        code, doc, stderr = verify_model(lab)
        after = accepted(lab)
    assert code == 1 and doc["ok"] is False, (doc.get("findings"), stderr)
    differs = [f for f in doc["findings"] if f["code"] == "node-differs"]
    assert [f["where"] for f in differs] == [VICTIM], differs  # spark3 only: the majority is right
    finding = differs[0]
    assert finding["severity"] == "error" and SHARD in finding["message"] and VICTIM in finding["message"]
    # only that shard differs, and the finding says how
    assert "1 file(s) differ" in finding["message"], finding
    what = "header" if fault == "other-revision" else "size"
    assert f"{SHARD} (" in finding["message"] and what in finding["message"].split(SHARD, 1)[1], finding
    assert VICTIM in finding["fix"]
    # the head's own folder is fine: no checkpoint finding beyond the cross-node one
    assert not [f for f in doc["findings"] if f["severity"] == "error" and f["code"] != "node-differs"], doc
    assert {n: after[n] - before[n] for n in NODES} == dict.fromkeys(NODES, 1)
