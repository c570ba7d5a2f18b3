"""Scan a checkpoint folder and describe it as one JSON document: the one checkpoint reader.

Runs on a node as `python3 - DIR [options]` with resources.probe_script("ckpt_scan.py") on stdin
(nodes don't have sparkctl installed: the script carries sparkctl.checkpoint.safetensors, its only sparkctl
import, with it); local mode imports `scan()`. It only reads and reports; sparkctl.checkpoint.verify turns the
report into findings, sparkctl.spec.planner.checkpoint_from_scan into the planner's input.

What it reports (see scan()):
  files   every regular file (top level and one folder down, dot-folders skipped): size, mtime_ns
  json    model.safetensors.index.json, config.json, quantization_config.json: sha256 + the bytes
          (in summary mode the index as its summary: per shard a count and a digest of names)
  shards  every *.safetensors (top level and one folder down): size, mtime_ns, header length,
          header sha256, and the raw header bytes or its summary (summarize_header: the tensors
          grouped by name pattern, dtype and shape), optionally sha256 of the first and last MiB
  deep    optionally the full sha256 of every shard (parallel threads, cached by path and file identity)

The header is read defensively (length checked against a cap and the file size, a bounded prefix
looked at first), so a hostile file costs a few KiB of reading, never a huge allocation.
Headers travel as zlib+base64 (58k+ tensor names compress ~10x), as summaries (232k tensors → a few
thousand entries), or not at all for nodes that only need to be compared by fingerprint.
Summaries, header hashes and fingerprints are cached on the node by file identity (SummaryCache):
an unchanged checkpoint is listed and stat'ed, not read.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import bisect
import gc
import hashlib
import json
import os
import re
import sys
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sparkctl.checkpoint.safetensors import (
    MAX_HEADER_BYTES,
    Header,
    HeaderError,
    parse_header,
    read_header_bytes,
)

VERSION = 2  # of the document and of SummaryCache: bump it whenever what a summary holds changes
MAX_JSON_BYTES = 128 * 1024 * 1024  # the index of a 58k-tensor pack is ~20 MB
MIB = 1024 * 1024
MAX_FILES = 20000
MAX_DEPTH = 8  # folders below the checkpoint's root that are listed (serving/ nests a layer's packages)
INDEX_NAME = "model.safetensors.index.json"
JSON_FILES = (INDEX_NAME, "config.json", "quantization_config.json")
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


def _sha_range(f: Any, start: int, length: int) -> str:
    f.seek(start)
    return hashlib.sha256(f.read(length)).hexdigest()


# ---------------------------------------------------------------- summaries


def names_digest(names: Any) -> str:
    """One hash of a set of tensor names, the same whether they come from a shard's header or from
    the index's weight_map: the sorted names joined by newlines, or as a JSON list when a name holds
    a newline itself (so that no two different sets can give the same text)."""
    ordered = sorted(names)
    text = "\n".join(ordered)
    if text.count("\n") != max(0, len(ordered) - 1):
        text = json.dumps(ordered, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _ranges(ids: list[int]) -> list[list[int]]:
    ids.sort()
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def summarize_kinds(kinds: Any) -> list[list[Any]]:
    """A shard's tensors (name -> TensorKind), losslessly grouped: one entry per distinct
    (name with its expert index taken out, dtype, shape), in first-seen order:

        [prefix, tail, dtype, shape, id ranges]   "model.layers.5.mlp.experts.", "up_proj.trellis", ...
        [name, None, dtype, shape, None]          every tensor that is not a numbered expert's

    A 232k-tensor pack becomes a few thousand entries; the rules (sparkctl.checkpoint.verify) read these, and
    the exact set of names and kinds can be rebuilt from them. The expert index is the first
    ".experts.N." of a name (N canonical decimal, at most 9 digits)."""
    names = list(kinds)
    joined = "\n".join(names)
    # C-level passes over all names at once (a Python call per name would cost ~1 s on 232k); a name
    # with a newline, a NUL or two expert indexes takes the per-name loop.
    if "\0" in joined:
        return _summarize_slow(kinds)
    ids = _EXPERT_NUM.findall(joined)
    t_joined = _EXPERT_NUM.sub(".experts.\0", joined)
    templated = t_joined.split("\n")
    if len(templated) != len(names) or _TWO_NUMS.search(t_joined):
        return _summarize_slow(kinds)
    groups: dict[tuple[Any, ...], list[int] | None] = {}
    numbered = iter(map(int, ids))
    for tmpl, kind in zip(templated, kinds.values(), strict=True):
        if "\0" in tmpl:
            key = (tmpl, kind)
            got = groups.get(key)
            if got is None:
                groups[key] = [next(numbered)]
            else:
                got.append(next(numbered))
        else:
            groups[(tmpl, kind)] = None
    out = []
    for (tmpl, kind), got in groups.items():
        if got is None:
            out.append([tmpl, None, kind.dtype, list(kind.shape), None])
        else:
            pre, _, tail = tmpl.partition("\0.")
            out.append([pre, tail, kind.dtype, list(kind.shape), _ranges(got)])
    return out


# ".experts.N" before a ".": a literal start, so the regex engine scans for it at C speed.
_EXPERT_NUM = re.compile(r"\.experts\.(0|[1-9][0-9]{0,8})(?=\.)")
_TWO_NUMS = re.compile("\0[^\n]*\0")


def _summarize_slow(kinds: Any) -> list[list[Any]]:
    """summarize_kinds one name at a time (names it cannot take in bulk); the same result."""
    groups: dict[tuple[Any, ...], list[int] | None] = {}
    for name, kind in kinds.items():
        m = _EXPERT_NUM.search(name)
        if m is None:
            groups[(name, None, kind)] = None
            continue
        key = (name[:m.start(1)], name[m.end(1) + 1:], kind)
        ids = groups.get(key)
        if ids is None:
            groups[key] = [int(m[1])]
        else:
            ids.append(int(m[1]))
    return [[pre, tail, kind.dtype, list(kind.shape), None if ids is None else _ranges(ids)]
            for (pre, tail, kind), ids in groups.items()]


def summarize_header(header: Header) -> dict[str, Any]:
    return {"tensors": len(header.kinds), "data_len": header.data_len, "names_sha256": names_digest(header.kinds),
            "groups": summarize_kinds(header.kinds)}


def summarize_index(raw: bytes) -> dict[str, Any]:
    """What the rules need of model.safetensors.index.json, without its 232k entries: per shard the
    number of tensors it names there and the digest of their names, and metadata.total_size."""
    enabled = gc.isenabled()
    gc.disable()  # 232k small objects and no cycles: the collector would only walk them again and again
    try:
        return _summarize_index(raw)
    finally:
        if enabled:
            gc.enable()


def _summarize_index(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return {"error": f"not valid JSON: {str(exc)[:120]}"}
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    total = meta.get("total_size") if isinstance(meta, dict) else None
    out: dict[str, Any] = {"total_size": total if isinstance(total, int) and not isinstance(total, bool) else None}
    if not isinstance(wm, dict) or not set(map(type, wm.values())) <= {str}:
        out["weight_map"] = False
        return out
    out["weight_map"] = True
    out["tensors"] = len(wm)
    shards: dict[str, Any] = {}
    # sorted by (shard, name) in C; then one slice of names per shard
    pairs = sorted(zip(wm.values(), wm.keys(), strict=True))
    col = [p[0] for p in pairs]
    start = 0
    while start < len(pairs):
        sname = col[start]
        end = bisect.bisect_right(col, sname, start)
        names = [p[1] for p in pairs[start:end]]
        shards[sname] = {"count": end - start, "names_sha256": names_digest(names)}
        start = end
    out["shards"] = shards
    return out


class SummaryCache:
    """Summaries (and fingerprints) of files on this node, keyed by path and the file's identity
    (size, mtime, inode, ctime: a rewrite or a replacement changes at least one), so an unchanged
    checkpoint is not read again. One JSON file, replaced atomically; a cache that cannot be read or
    written only costs the time of reading the headers."""

    LIMIT = 4096  # files; about 40 checkpoints of 100 shards

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data = _load_cache(path) if path else {}
        if self.data.get("version") != VERSION or not isinstance(self.data.get("files"), dict):
            self.data = {"version": VERSION, "files": {}}
        self.files: dict[str, Any] = self.data["files"]
        self.dirty = False
        self.hits = 0

    @staticmethod
    def identity(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]

    def get(self, path: str, st: os.stat_result, field: str, *, count: bool = True) -> Any:
        entry = self.files.get(path)
        if isinstance(entry, dict) and entry.get("id") == self.identity(st) and field in entry:
            self.hits += count
            return entry[field]
        return None

    def header(self, path: str, st: os.stat_result, max_header_bytes: int, *, summary: bool,
               count: bool = True) -> dict[str, Any] | None:
        """The cached header facts of this very file, read under the same cap (and with its summary
        when `summary`), or None: then the header must be read."""
        known = self.get(path, st, "header", count=count)
        if isinstance(known, dict) and known.get("max") == max_header_bytes \
                and (not summary or isinstance(known.get("summary"), dict)):
            return known
        return None

    def fingerprints(self, path: str, st: os.stat_result, *, count: bool = True) -> list[str] | None:
        fp = self.get(path, st, "fingerprints", count=count)
        return fp if isinstance(fp, list) and len(fp) == 2 else None

    def put(self, path: str, st: os.stat_result, **fields: Any) -> None:
        entry = self.files.get(path)
        ident = self.identity(st)
        if not isinstance(entry, dict) or entry.get("id") != ident:
            entry = self.files[path] = {"id": ident}
        entry.update(fields)
        self.dirty = True

    def save(self) -> None:
        if not (self.path and self.dirty):
            return
        for path in [p for p in self.files if not os.path.exists(p)]:  # files that are gone
            del self.files[path]
        while len(self.files) > self.LIMIT:  # then the oldest first (dicts keep insertion order)
            del self.files[next(iter(self.files))]
        _save_cache(self.path, self.data)


def default_summary_cache() -> str:
    return os.path.join(os.path.dirname(default_cache_file()), "ckpt-summaries.json")


def scan_shard(path: str, *, headers: str = "raw", fingerprints: bool = False,
               max_header_bytes: int = MAX_HEADER_BYTES, cache: SummaryCache | None = None) -> dict[str, Any]:
    """Describe one safetensors file; problems go into "error" ({code, message}), never raised.

    headers: "raw"/"zlib" the header itself, "none" only its hash, "summary" its summary
    (summarize_header) instead of the header; with a cache, what it holds for this very file is
    used instead of reading it again."""
    out: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            out["size"] = st.st_size
            out["mtime_ns"] = st.st_mtime_ns
            key = os.path.realpath(path)
            if fingerprints:
                # First and last MiB: cheap evidence that two nodes hold the same bytes.
                fp = cache.fingerprints(key, st) if cache else None
                if fp is None:
                    fp = [_sha_range(f, 0, MIB), _sha_range(f, max(0, st.st_size - MIB), MIB)]
                    if cache:
                        cache.put(key, st, fingerprints=fp)
                out["head_sha256"], out["tail_sha256"] = fp
                f.seek(0)
            want_summary = headers == "summary"
            known = cache.header(key, st, max_header_bytes, summary=want_summary) \
                if cache and headers in ("none", "summary") else None
            if known is not None:
                out.update({k: v for k, v in known.items() if k != "max"})
                if not want_summary:
                    out.pop("summary", None)
                return out
            raw = read_header_bytes(f, st.st_size, max_header_bytes=max_header_bytes)
            out["header_len"] = len(raw)
            out["header_sha256"] = hashlib.sha256(raw).hexdigest()
            if want_summary:
                try:
                    out["summary"] = summarize_header(parse_header(raw))
                except HeaderError as exc:
                    out["error"] = {"code": exc.code, "message": exc.message}
            else:
                out["header"] = _encode(raw, headers)
            if cache and headers in ("none", "summary"):
                keep = {k: out[k] for k in ("header_len", "header_sha256", "summary", "error") if k in out}
                cache.put(key, st, header={**keep, "max": max_header_bytes})
    except HeaderError as exc:
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
                elif e.is_dir() and depth < MAX_DEPTH and not e.is_symlink() and not e.name.startswith("."):
                    visit(e.path, name + "/", depth + 1)
            except OSError:
                continue

    visit(root, "", 0)
    return files, truncated


def _read_json_file(path: str, mode: str, cache: SummaryCache | None = None) -> dict[str, Any]:
    """A JSON file as its bytes (mode raw/zlib), only its hash (none), or, for the index in summary
    mode, its summary (summarize_index) instead of its 20 MB: cached like the shards' summaries."""
    index = mode == "summary" and os.path.basename(path) == INDEX_NAME
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size > MAX_JSON_BYTES:
                return {"size": st.st_size, "error": {"code": "json-too-large",
                                                      "message": f"{st.st_size} bytes exceeds the cap"}}
            key = os.path.realpath(path)
            known = cache.get(key, st, "index") if cache and index else None
            if isinstance(known, dict):
                return known
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        return {"missing": True}
    except OSError as exc:
        return {"error": {"code": "io", "message": f"cannot read: {exc.strerror or exc}"}}
    out: dict[str, Any] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    if index:
        out["summary"] = summarize_index(raw)
        if cache:
            cache.put(key, st, index=out)
    else:
        out["data"] = _encode(raw, "zlib" if mode == "summary" else mode)
    return out


# ---------------------------------------------------------------- deep hashes


def default_cache_file() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparkctl", "deep-hashes.json")


def _load_cache(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(64 * MIB))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):  # unreadable, damaged or absurdly nested: start afresh
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
    """sha256 of every file, in parallel, reusing a cached result only for the very same file: keyed by its
    realpath and its identity (size, mtime, inode, ctime, as SummaryCache), so a different file copied over
    it with the same size and mtime (`cp -p`, `rsync -a`) is hashed again. An entry without that identity
    (a cache from before) is never trusted.

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
        if isinstance(hit, dict) and hit.get("id") == SummaryCache.identity(st) and isinstance(hit.get("sha256"), str):
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
            cache[key] = {"id": SummaryCache.identity(st), "sha256": digest}

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
         progress: Progress | None = None, shards: bool = True, summary_cache: str | None = None) -> dict[str, Any]:
    """Describe the checkpoint folder `directory`.

    headers: "raw" (bytes, for in-process use), "zlib" (base64 of zlib, for JSON over SSH),
    "none" (hashes only: enough to compare a node with the head) or "summary" (what the rules need:
    per shard its summary, for the index its summary; config files zlib). shards=False leaves the
    shards out (what the planner needs: config.json, the index, the file sizes).
    summary_cache: the cache file for "none" and "summary" ("" for none at all; default under
    ~/.cache/sparkctl), so an unchanged file is not read twice.
    """
    root = os.path.abspath(directory)
    doc: dict[str, Any] = {"probe": "ckpt_scan", "version": VERSION, "host": os.uname().nodename,
                           "dir": root, "headers": headers}
    if not os.path.isdir(root):
        doc["error"] = {"code": "dir-missing", "message": f"{root} is not a folder on this node"}
        return doc
    cache = None
    if headers in ("none", "summary") or fingerprints:
        cache = SummaryCache(default_summary_cache() if summary_cache is None else summary_cache or None)
    files, truncated = _list_files(root)
    doc["files"] = files
    doc["files_truncated"] = truncated
    names = [n for n in files if n.endswith(".safetensors")] if shards else []
    with _Summarizers(root, names, headers, fingerprints, max_header_bytes, cache) as early:
        # the shards the cache lacks are read by worker processes meanwhile
        doc["json"] = {name: _read_json_file(os.path.join(root, name), headers, cache) for name in JSON_FILES}
        doc["shards"] = {n: early.get(n) or scan_shard(os.path.join(root, n), headers=headers,
                                                       fingerprints=fingerprints, max_header_bytes=max_header_bytes,
                                                       cache=cache) for n in names}
    if cache is not None:
        doc["cache_hits"] = cache.hits
        cache.save()
    if deep:
        got = deep_hashes([os.path.join(root, n) for n in names], workers=workers, cache_file=cache_file,
                          progress=progress)
        doc["deep"] = {n: got[os.path.join(root, n)] for n in names}
    return doc


def _summarize_uncached(path: str, fingerprints: bool, max_header_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """scan_shard in a worker process: the result and the cache entries it made (the parent keeps them)."""
    local = SummaryCache(None)
    out = scan_shard(path, headers="summary", fingerprints=fingerprints, max_header_bytes=max_header_bytes,
                     cache=local)
    return out, local.files


def _worker_signals() -> None:
    """A worker only reads: Ctrl-C is the parent's to handle, and SIGTERM (the pool's end) just ends it,
    whatever handlers the parent had installed (the sparkctl CLI has its own) when it forked."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Summarizers:
    """Summaries of the shards the cache lacks, made by worker processes (fork) while the caller reads
    the index: on a cold cache that is most of a scan, and one shard's header parses in one core.
    Only with several cold shards, more than one CPU and no other thread (fork copies only the
    caller's); anything else, and any failure of the pool, leaves the shards to the caller."""

    MIN_SHARDS = 4

    def __init__(self, root: str, names: list[str], headers: str, fingerprints: bool, max_header_bytes: int,
                 cache: SummaryCache | None) -> None:
        self.pending: dict[str, Any] = {}
        self.pool: Any = None
        self.cache = cache
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if headers != "summary" or cpus < 2 or threading.active_count() > 1:
            return
        cold = []
        for n in names:
            path = os.path.join(root, n)
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = os.path.realpath(path)
            if not (cache and cache.header(key, st, max_header_bytes, summary=True, count=False)
                    and (not fingerprints or cache.fingerprints(key, st, count=False))):
                cold.append(n)
        if len(cold) < self.MIN_SHARDS:
            return
        try:
            import multiprocessing

            self.pool = multiprocessing.get_context("fork").Pool(min(cpus, 8, len(cold)), initializer=_worker_signals)
            for n in cold:
                self.pending[n] = self.pool.apply_async(
                    _summarize_uncached, (os.path.join(root, n), fingerprints, max_header_bytes))
        except (OSError, ValueError, ImportError):
            self.pending = {}

    def __enter__(self) -> _Summarizers:
        return self

    def get(self, name: str) -> dict[str, Any] | None:
        job = self.pending.pop(name, None)
        if job is None:
            return None
        try:
            out, entries = job.get(timeout=600)
        except Exception:  # noqa: BLE001 - a worker's failure: the caller reads this shard itself
            return None
        if self.cache is not None:
            self.cache.files.update(entries)
            self.cache.dirty = True
        return dict(out)

    def __exit__(self, *exc: object) -> None:
        # Never Pool.terminate(): a worker killed while it holds the task queue's lock leaves the others
        # blocked on it, and join() then waits for ever (the unit suite once hung so). Each job is one
        # header, so the workers finish theirs, take their end-of-work sentinel and exit by themselves.
        if self.pool is not None:
            self.pool.close()
            self.pool.join()


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
    ap.add_argument("--headers", choices=("zlib", "none", "summary"), default="zlib",
                    help="send shard headers (zlib+base64), only their hashes, or their summaries")
    ap.add_argument("--no-shards", action="store_true", help="config files, the index and the listing only")
    ap.add_argument("--summary-cache", default=None, help="summary cache file ('' for none)")
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
               progress=progress, shards=not args.no_shards, summary_cache=args.summary_cache)
    sys.stdout.write(json.dumps(doc, separators=(",", ":")))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
