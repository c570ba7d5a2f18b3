"""`--deep`'s hash cache on the node trusts a file only while it is the very same file.

The cache saves re-reading 300 GB; a hit hands back the sha256 of what was there before. A different file of
the same size with the old mtime (what `cp -p` and `rsync -a` leave) must be hashed again: the cache is keyed on
the file's identity (size, mtime, inode, ctime), as the summary cache is. Each run here is the real probe,
`python3 - DIR --headers none --deep --cache FILE`, with the script on stdin as a node runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sparkctl.spec.resources import probe_script

SHARD = "model-00001-of-00001.safetensors"


def _deep(model: Path, cache: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-I", "-", str(model), "--headers", "none", "--deep", "--cache", str(cache)],
                         input=probe_script("ckpt_scan.py"), capture_output=True, timeout=60, check=True, cwd="/")
    deep: dict[str, Any] = json.loads(out.stdout)["deep"]
    return deep[SHARD]


def _shard(body: bytes) -> bytes:
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(body)], "data_offsets": [0, len(body)]}}).encode()
    return len(header).to_bytes(8, "little") + header + body


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / SHARD).write_bytes(_shard(b"A" * 4096))
    return d


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_an_unchanged_file_is_a_hit(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "deep.json"
    first, second = _deep(model, cache), _deep(model, cache)
    assert (first["cached"], second["cached"]) == (False, True)
    assert first["sha256"] == second["sha256"] == _sha(model / SHARD)


def test_same_size_other_content_with_the_old_mtime_is_hashed_again(model: Path, tmp_path: Path) -> None:
    """What `cp -p` does: new bytes written into the file, then its old times put back."""
    cache, shard = tmp_path / "deep.json", model / SHARD
    before = _deep(model, cache)
    st = shard.stat()
    time.sleep(0.01)  # a ctime tick, however coarse the file system's clock
    shard.write_bytes(_shard(b"B" * 4096))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    after = _deep(model, cache)
    assert after == {"sha256": _sha(shard), "cached": False}
    assert after["sha256"] != before["sha256"]


@pytest.mark.parametrize("tool", ["cp", "rsync"])
def test_a_file_copied_over_with_its_times_is_hashed_again(model: Path, tmp_path: Path, tool: str) -> None:
    """The real `cp -p` (rewrites the same inode) and `rsync -a` (renames a new one in) of another file
    that has the size and mtime of the file hashed. rsync skips a file whose size and mtime already match,
    so there the file was changed in between (unhashed): rsync then puts the hashed file's mtime back."""
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    cache, shard = tmp_path / "deep.json", model / SHARD
    other = tmp_path / "other" / SHARD
    other.parent.mkdir()
    other.write_bytes(_shard(b"C" * 4096))
    st = shard.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    _deep(model, cache)
    time.sleep(0.01)
    if tool == "rsync":
        shard.write_bytes(_shard(b"D" * 4096))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))  # rsync compares whole seconds
    argv = ["cp", "-p", str(other), str(shard)] if tool == "cp" else ["rsync", "-a", str(other), str(shard)]
    subprocess.run(argv, check=True, timeout=30)
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert _deep(model, cache) == {"sha256": _sha(other), "cached": False}


def test_an_entry_of_the_old_cache_without_the_files_identity_is_not_trusted(model: Path, tmp_path: Path) -> None:
    """A cache written before (path -> size, mtime, sha256 only) is never a hit: the file is hashed again."""
    cache, shard = tmp_path / "deep.json", model / SHARD
    st = shard.stat()
    cache.write_text(json.dumps({os.path.realpath(shard): {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                           "sha256": "0" * 64}}))
    assert _deep(model, cache) == {"sha256": _sha(shard), "cached": False}
    assert _deep(model, cache)["cached"] is True  # and the new entry is one


@pytest.mark.parametrize("junk", ["[" * 100_000, '{"a":' * 50_000, "[]", "{", '{"x": 3}'])
def test_a_damaged_cache_is_started_afresh(model: Path, tmp_path: Path, junk: str) -> None:
    cache = tmp_path / "deep.json"
    cache.write_text(junk)
    assert _deep(model, cache) == {"sha256": _sha(model / SHARD), "cached": False}
