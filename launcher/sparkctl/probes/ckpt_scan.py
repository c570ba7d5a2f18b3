"""Scan a checkpoint folder and describe it as one JSON document. STDLIB ONLY: no sparkctl imports.

Runs on a node as `python3 - DIR [options] < ckpt_scan.py` (nodes don't have sparkctl installed);
local mode imports `scan()`. It only reads and reports; sparkctl.verify turns the report into findings.

What it reports (see scan()):
  files   every regular file (top level and one folder down, dot-folders skipped): size, mtime_ns
  json    model.safetensors.index.json, config.json, quantization_config.json: sha256 + the bytes
  shards  every *.safetensors (top level and one folder down): size, mtime_ns, header length,
          header sha256, the raw header bytes, and optionally sha256 of the first and last MiB
  deep    optionally the full sha256 of every shard (parallel threads, cached by path/size/mtime)

The header is read defensively (length checked against a cap and the file size, a bounded prefix
looked at first), so a hostile file costs a few KiB of reading, never a huge allocation.
Headers travel as zlib+base64 (58k+ tensor names compress ~10x), or not at all for nodes that only
need to be compared by fingerprint.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

VERSION = 1
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_JSON_BYTES = 128 * 1024 * 1024  # the index of a 58k-tensor pack is ~20 MB
PREFIX_BYTES = 64 * 1024
MIB = 1024 * 1024
MAX_FILES = 20000
JSON_FILES = ("model.safetensors.index.json", "config.json", "quantization_config.json")
DEEP_CHUNK = 8 * MIB

Progress = Callable[[int], None]


class ScanError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _encode(raw: bytes, mode: str) -> Any:
    if mode == "raw":
        return raw
    if mode == "zlib":
        return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")
    return None


def decode_blob(blob: Any) -> bytes | None:
    """The inverse of the header/json encoding: bytes as they were on disk (None if not sent)."""
    if blob is None:
        return None
    if isinstance(blob, (bytes, bytearray)):
        return bytes(blob)
    # zlib.decompress of attacker-ish data could be a bomb; bound the output to the header cap.
    if not isinstance(blob, str):
        raise ValueError(f"an encoded blob must be a string, not {type(blob).__name__}")
    try:
        d = zlib.decompressobj()
        out = d.decompress(base64.b64decode(blob, validate=True), MAX_JSON_BYTES + 1)
    except (zlib.error, binascii.Error) as exc:  # what a node printed: a finding, not a crash
        raise ValueError(f"corrupt encoded blob ({exc})") from None
    if len(out) > MAX_JSON_BYTES:
        raise ValueError("decompressed blob exceeds the cap")
    return out


def _read_header(f: Any, size: int, cap: int) -> bytes:
    # Same rules as sparkctl.safetensors.read_header_bytes (duplicated because this file must
    # run alone on a node): cap and file size checked before reading, prefix checked first.
    prefix = f.read(8)
    if len(prefix) < 8:
        raise ScanError("header-short", f"file is {size} bytes: too short for the 8-byte header length")
    n = int.from_bytes(prefix, "little")
    if n > cap:
        raise ScanError("header-too-large", f"header length {n} exceeds the {cap}-byte cap (corrupt or not safetensors)")
    if 8 + n > size:
        raise ScanError("header-past-eof", f"header length {n} points past the end of the {size}-byte file")
    if n < 2:
        raise ScanError("header-json", f"header length {n} is too small for a JSON object")
    head = f.read(min(n, PREFIX_BYTES))
    if not head.lstrip(b" ").startswith(b"{"):
        raise ScanError("header-json", "header does not start with a JSON object (garbage or not safetensors)")
    raw = head + (f.read(n - len(head)) if n > len(head) else b"")
    if len(raw) != n:
        raise ScanError("header-past-eof", f"header is {n} bytes but the file ended after {len(raw)}")
    return raw


def _sha_range(f: Any, start: int, length: int) -> str:
    f.seek(start)
    return hashlib.sha256(f.read(length)).hexdigest()


def scan_shard(path: str, *, headers: str = "raw", fingerprints: bool = False,
               max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Describe one safetensors file; problems go into "error" ({code, message}), never raised."""
    out: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            out["size"] = st.st_size
            out["mtime_ns"] = st.st_mtime_ns
            if fingerprints:
                # First and last MiB: cheap evidence that two nodes hold the same bytes.
                out["head_sha256"] = _sha_range(f, 0, MIB)
                out["tail_sha256"] = _sha_range(f, max(0, st.st_size - MIB), MIB)
                f.seek(0)
            raw = _read_header(f, st.st_size, max_header_bytes)
            out["header_len"] = len(raw)
            out["header_sha256"] = hashlib.sha256(raw).hexdigest()
            out["header"] = _encode(raw, headers)
    except ScanError as exc:
        out["error"] = {"code": exc.code, "message": exc.message}
    except OSError as exc:
        out["error"] = {"code": "io", "message": f"cannot read: {exc.strerror or exc}"}
    return out


def _list_files(root: str) -> tuple[dict[str, dict[str, int]], bool]:
    files: dict[str, dict[str, int]] = {}
    truncated = False

    def visit(folder: str, rel: str, depth: int) -> None:
        nonlocal truncated
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if len(files) >= MAX_FILES:
                truncated = True
                return
            name = rel + e.name
            try:
                if e.is_file():
                    st = e.stat()
                    files[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
                elif e.is_dir() and depth < 1 and not e.name.startswith("."):
                    visit(e.path, name + "/", depth + 1)
            except OSError:
                continue

    visit(root, "", 0)
    return files, truncated


def _read_json_file(path: str, mode: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                return {"size": size, "error": {"code": "json-too-large", "message": f"{size} bytes exceeds the cap"}}
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        return {"missing": True}
    except OSError as exc:
        return {"error": {"code": "io", "message": f"cannot read: {exc.strerror or exc}"}}
    return {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest(), "data": _encode(raw, mode)}


# ---------------------------------------------------------------- deep hashes


def default_cache_file() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparkctl", "deep-hashes.json")


def _load_cache(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(64 * MIB))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: str, cache: dict[str, Any]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, path)  # atomic: a concurrent run never sees half a file
    except OSError:
        pass  # a cache that cannot be written only costs time next run


def sha256_file(path: str, progress: Progress | None = None) -> str:
    """Full sha256 with large reads into one reused buffer; hashlib drops the GIL while hashing."""
    h = hashlib.sha256()
    buf = bytearray(DEEP_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if progress:
                progress(n)
    return h.hexdigest()


def deep_hashes(paths: list[str], *, workers: int | None = None, cache_file: str | None = None,
                progress: Progress | None = None) -> dict[str, dict[str, Any]]:
    """sha256 of every file, in parallel, reusing cached results keyed by (realpath, size, mtime_ns).

    Returns {path: {"sha256": hex, "cached": bool}} or {path: {"error": ...}} per file.
    """
    cache_path = cache_file or default_cache_file()
    cache = _load_cache(cache_path)
    lock = threading.Lock()
    results: dict[str, dict[str, Any]] = {}
    todo: list[tuple[str, str, os.stat_result]] = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as exc:
            results[p] = {"error": {"code": "io", "message": f"cannot stat: {exc.strerror or exc}"}}
            continue
        key = os.path.realpath(p)
        hit = cache.get(key)
        if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            results[p] = {"sha256": hit.get("sha256"), "cached": True}
            if progress:
                progress(st.st_size)
        else:
            todo.append((p, key, st))

    def work(item: tuple[str, str, os.stat_result]) -> None:
        p, key, st = item
        try:
            digest = sha256_file(p, progress)
        except OSError as exc:
            with lock:
                results[p] = {"error": {"code": "io", "message": f"cannot read: {exc.strerror or exc}"}}
            return
        with lock:
            results[p] = {"sha256": digest, "cached": False}
            cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}

    if todo:
        # Biggest first so the pool does not end waiting on one late large file.
        todo.sort(key=lambda t: -t[2].st_size)
        n = workers or min(8, max(2, os.cpu_count() or 2))
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(work, todo))
        _save_cache(cache_path, cache)
    return results


# ---------------------------------------------------------------- the scan


def scan(directory: str, *, headers: str = "raw", fingerprints: bool = False, deep: bool = False,
         max_header_bytes: int = MAX_HEADER_BYTES, workers: int | None = None, cache_file: str | None = None,
         progress: Progress | None = None) -> dict[str, Any]:
    """Describe the checkpoint folder `directory`.

    headers: "raw" (bytes, for in-process use), "zlib" (base64 of zlib, for JSON over SSH) or
    "none" (hashes only: enough to compare a node with the head).
    """
    root = os.path.abspath(directory)
    doc: dict[str, Any] = {"probe": "ckpt_scan", "version": VERSION, "host": socket.gethostname(),
                           "dir": root, "headers": headers}
    if not os.path.isdir(root):
        doc["error"] = {"code": "dir-missing", "message": f"{root} is not a folder on this node"}
        return doc
    files, truncated = _list_files(root)
    doc["files"] = files
    doc["files_truncated"] = truncated
    doc["json"] = {name: _read_json_file(os.path.join(root, name), headers) for name in JSON_FILES}
    names = [n for n in files if n.endswith(".safetensors")]
    doc["shards"] = {n: scan_shard(os.path.join(root, n), headers=headers, fingerprints=fingerprints,
                                   max_header_bytes=max_header_bytes) for n in names}
    if deep:
        got = deep_hashes([os.path.join(root, n) for n in names], workers=workers, cache_file=cache_file,
                          progress=progress)
        doc["deep"] = {n: got[os.path.join(root, n)] for n in names}
    return doc


def _stderr_progress(total: int) -> Progress:
    lock = threading.Lock()
    state = {"done": 0, "last": 0.0}

    def tick(n: int) -> None:
        with lock:
            state["done"] += n
            now = time.monotonic()
            if now - state["last"] >= 2.0 or state["done"] >= total:
                state["last"] = now
                pct = 100.0 * state["done"] / total if total else 100.0
                sys.stderr.write(f"deep: {state['done'] / 1e9:.1f}/{total / 1e9:.1f} GB ({pct:.0f}%)\n")

    return tick


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ckpt_scan", description="Describe a safetensors checkpoint folder as JSON.")
    ap.add_argument("dir")
    ap.add_argument("--headers", choices=("zlib", "none"), default="zlib",
                    help="send shard headers (zlib+base64) or only their hashes")
    ap.add_argument("--fingerprints", action="store_true", help="also hash the first and last MiB of each shard")
    ap.add_argument("--deep", action="store_true", help="full sha256 of every shard (cached)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--cache", default=None, help="deep-hash cache file")
    ap.add_argument("--max-header-bytes", type=int, default=MAX_HEADER_BYTES)
    ap.add_argument("--progress", action="store_true", help="deep: progress lines on stderr")
    args = ap.parse_args(argv)
    progress = None
    if args.deep and args.progress:
        total = sum(e.stat().st_size for e in os.scandir(args.dir) if e.name.endswith(".safetensors")) \
            if os.path.isdir(args.dir) else 0
        progress = _stderr_progress(total)
    doc = scan(args.dir, headers=args.headers, fingerprints=args.fingerprints, deep=args.deep,
               max_header_bytes=args.max_header_bytes, workers=args.workers, cache_file=args.cache,
               progress=progress)
    sys.stdout.write(json.dumps(doc, separators=(",", ":")))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
