"""A bounded, defensive reader for safetensors headers.

A safetensors file is an 8-byte little-endian header length N, then N bytes of JSON
(tensor name -> {"dtype", "shape", "data_offsets"}, plus an optional "__metadata__" of strings),
then the data. Offsets are relative to the start of the data and, as the reference implementation
insists, the tensors tile the data region exactly: sorted by offset, no overlap, no hole, and the
last one ends where the file ends.

Everything here treats the file as hostile: the header length is checked against a cap and the
file size before anything is read, a bounded prefix is looked at before the rest is read (so 100 MB
of garbage is rejected after reading a few KiB), and every field is type-checked. Any problem is a
`HeaderError` with a short `code`; no other exception escapes for any input.
"""

from __future__ import annotations

import gc
import json
import os
import re
from collections.abc import Iterable, Mapping
from itertools import chain
from operator import itemgetter
from typing import Any, BinaryIO, NamedTuple

#: Default cap on the JSON header. The full 3.00 bpw GLM-5.3 shard headers are ~1 MB each;
#: the reference implementation itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: How much of a header is read to decide it is not JSON at all before reading the rest.
PREFIX_BYTES = 64 * 1024
#: Tensors with more dimensions than this are not something any checkpoint holds.
MAX_DIMS = 8

#: Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
#: Bytes per element for the byte-aligned dtypes (the sub-byte ones are packed, see nbytes()).
DTYPE_SIZE: dict[str, int] = {k: v // 8 for k, v in DTYPE_BITS.items() if v % 8 == 0}


class HeaderError(ValueError):
    """The header is unreadable, malformed, or inconsistent. `code` says which, for findings."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TensorInfo(NamedTuple):
    """One tensor's header entry. `begin`/`end` are offsets into the data region."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class Header(NamedTuple):
    header_len: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_len: int  # end of the last tensor = the data region's size the file must have

    @property
    def file_size(self) -> int:
        """The exact size a file with this header must have."""
        return 8 + self.header_len + self.data_len


def nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes a tensor of `dtype` and `shape` occupies (packed for sub-byte dtypes)."""
    n = 1
    for d in shape:
        n *= d
    return (n * DTYPE_BITS[dtype] + 7) // 8


def read_header_bytes(f: BinaryIO, file_size: int, *, max_header_bytes: int = MAX_HEADER_BYTES) -> bytes:
    """Read the raw JSON header of an open safetensors file, never more than the cap.

    Checks, in order, before reading anything large: the length prefix exists, the header fits
    the cap and the file, and the first bytes look like a JSON object.
    """
    prefix = f.read(8)
    if len(prefix) < 8:
        raise HeaderError("header-short", f"file is {file_size} bytes: too short for the 8-byte header length")
    n = int.from_bytes(prefix, "little")
    if n > max_header_bytes:
        raise HeaderError("header-too-large",
                          f"header length {n} exceeds the {max_header_bytes}-byte cap (corrupt or not safetensors)")
    if 8 + n > file_size:
        raise HeaderError("header-past-eof",
                          f"header length {n} points past the end of the {file_size}-byte file")
    if n < 2:
        raise HeaderError("header-json", f"header length {n} is too small for a JSON object")
    head = f.read(min(n, PREFIX_BYTES))
    if not head.lstrip(b" ").startswith(b"{"):
        raise HeaderError("header-json", "header does not start with a JSON object (garbage or not safetensors)")
    rest = f.read(n - len(head)) if n > len(head) else b""
    raw = head + rest
    if len(raw) != n:
        raise HeaderError("header-past-eof", f"header is {n} bytes but the file ended after {len(raw)}")
    return raw


def parse_header(raw: bytes) -> Header:
    """Parse and validate a raw header (the file's size is the caller's check: Header.file_size)."""
    # json builds one dict and two lists per tensor; with 6k tensors per shard the cyclic GC
    # would run hundreds of times for nothing (nothing here forms cycles), doubling the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        fast = _fast_parse(raw)
        if fast is not None:
            return fast
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise HeaderError("header-json", f"header is not valid JSON: {str(exc)[:200]}") from None
        return _validate(doc, len(raw))
    finally:
        if enabled:
            gc.enable()


# The reference writer emits compact JSON with a fixed key order, which a regex reads about 3x
# faster than json.loads + per-entry checks (verify-model's budget is 1 s for 58k+ tensors).
# The fast path is taken only when the matches tile the whole body; anything else (spaces,
# escapes, other key orders, odd numbers) goes through json.loads and _validate.
_INT = r"(?:0|[1-9][0-9]{0,18})"
_ENTRY = re.compile(r'"([^"\\]*)":\{"dtype":"([A-Z0-9_]{1,16})","shape":\[((?:' + _INT + r"(?:," + _INT
                    + r')*)?)\],"data_offsets":\[(' + _INT + r"),(" + _INT + r")\]\}(,?)")
_ENTRY_FIXED = len('"":{"dtype":"","shape":[],"data_offsets":[,]}')


def _fast_parse(raw: bytes) -> Header | None:
    try:
        text = raw.decode("ascii").rstrip(" ")
    except UnicodeDecodeError:
        return None
    if not (text.startswith("{") and text.endswith("}")):
        return None
    body = text[1:-1]
    metadata: dict[str, str] = {}
    if body.startswith('"__metadata__":'):
        try:
            meta, end = json.JSONDecoder().raw_decode(body, len('"__metadata__":'))
        except ValueError:
            return None
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            return None
        if body[end:end + 1] != ",":
            return None if body[end:] else Header(len(raw), {}, meta, 0)
        metadata, body = meta, body[end + 1:]
    matches = _ENTRY.findall(body)
    if not matches or matches[-1][5] or sum(map(len, map(itemgetter(5), matches))) != len(matches) - 1:
        return None
    # The matches tile the body iff their lengths add up to it (findall never overlaps them).
    if sum(map(len, chain.from_iterable(matches))) + len(matches) * _ENTRY_FIXED != len(body):
        return None
    tensors: dict[str, TensorInfo] = {}
    begins: list[int] = []
    ends: list[int] = []
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    bits = DTYPE_BITS
    new = tuple.__new__
    for name, dtype, shape_s, b, e, _ in matches:
        known = shapes.get(shape_s)
        if known is None:
            shape = tuple(int(x) for x in shape_s.split(",")) if shape_s else ()
            if len(shape) > MAX_DIMS:
                return None  # let the slow path produce the precise error
            numel = 1
            for d in shape:
                numel *= d
            known = shapes[shape_s] = (shape, numel)
        width = bits.get(dtype)
        begin, end = int(b), int(e)
        if width is None or end - begin != (known[1] * width + 7) >> 3:
            return None
        tensors[name] = new(TensorInfo, (dtype, known[0], begin, end))
        begins.append(begin)
        ends.append(end)
    if len(tensors) != len(matches) or "__metadata__" in tensors:
        return None  # duplicate names: the slow path decides what they mean
    # Writers emit tensors in offset order: then "tiles exactly" is two list comparisons in C.
    if begins[0] == 0 and begins[1:] == ends[:-1]:
        return Header(len(raw), tensors, metadata, ends[-1])
    return Header(len(raw), tensors, metadata,
                  _check_tiling([(t.begin, t.end, n) for n, t in tensors.items()]))


def _validate(doc: Any, header_len: int) -> Header:
    if not isinstance(doc, dict):
        raise HeaderError("header-json", f"header is a JSON {type(doc).__name__}, not an object")
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    bits = DTYPE_BITS
    # The hot loop of verify-model (58k+ tensors per pack): plain loops and exact type checks,
    # no generator expressions; anything unusual drops to _entry_error for the precise message.
    for name, entry in doc.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise HeaderError("header-metadata", "__metadata__ must be an object of strings")
            metadata = entry
            continue
        if type(entry) is not dict:
            raise HeaderError("header-entry", f"tensor {_short(name)}: entry is not an object")
        dtype = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if (type(dtype) is not str or dtype not in bits or type(shape) is not list or len(shape) > MAX_DIMS
                or type(offsets) is not list or len(offsets) != 2):
            raise _entry_error(name, dtype, shape, offsets)
        n = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise _entry_error(name, dtype, shape, offsets)
            n *= d
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
            raise _entry_error(name, dtype, shape, offsets)
        want = (n * bits[dtype] + 7) >> 3
        if end - begin != want:
            raise HeaderError("tensor-bytes", f"tensor {name}: {dtype}{shape} needs {want} bytes but data_offsets "
                                              f"[{begin}, {end}] hold {end - begin}")
        tensors[name] = TensorInfo(dtype, tuple(shape), begin, end)
        spans.append((begin, end, name))
    return Header(header_len, tensors, metadata, _check_tiling(spans))


def _entry_error(name: str, dtype: Any, shape: Any, offsets: Any) -> HeaderError:
    if type(dtype) is not str or dtype not in DTYPE_BITS:
        return HeaderError("header-dtype", f"tensor {_short(name)}: unknown dtype {_short(repr(dtype))}")
    if type(shape) is not list or len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
        return HeaderError("header-shape", f"tensor {_short(name)}: shape {_short(repr(shape))} is not a list "
                                           f"of at most {MAX_DIMS} non-negative integers")
    return HeaderError("header-offsets", f"tensor {_short(name)}: data_offsets {_short(repr(offsets))} "
                                         "is not [begin, end] with 0 <= begin <= end")


def _check_tiling(spans: list[tuple[int, int, str]]) -> int:
    """Offsets must tile [0, end) exactly: sorted, no overlap, no hole. Returns the end."""
    spans.sort()
    pos = 0
    prev = ""
    for begin, end, name in spans:
        if begin < pos:
            raise HeaderError("offsets-overlap", f"tensor {name} [{begin}, {end}] overlaps tensor {prev} "
                                                 f"(which ends at {pos})")
        if begin > pos and end > begin:
            raise HeaderError("offsets-gap", f"hole of {begin - pos} bytes before tensor {name} "
                                             f"(previous tensor {prev or '-'} ends at {pos})")
        if end > pos:
            pos = end
            prev = name
    return pos


def read_header(path: str | os.PathLike[str], *, max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    """Read and validate the header of the safetensors file at `path`.

    Raises HeaderError for every problem with the file, including I/O errors (code "io").
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = read_header_bytes(f, size, max_header_bytes=max_header_bytes)
    except OSError as exc:
        raise HeaderError("io", f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_header(raw)


def encode_header(tensors: Mapping[str, tuple[str, Iterable[int]]],
                  metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, TensorInfo]]:
    """Lay tensors out back to back (in the given order) and return (header JSON, layout).

    The JSON is compact and padded with spaces to a multiple of 8 bytes, as the reference writer does,
    so the data region starts aligned.
    """
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    layout: dict[str, TensorInfo] = {}
    pos = 0
    for name, (dtype, shape) in tensors.items():
        shp = tuple(shape)
        n = nbytes(dtype, shp)
        layout[name] = TensorInfo(dtype, shp, pos, pos + n)
        doc[name] = {"dtype": dtype, "shape": list(shp), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, layout


def _short(s: str, limit: int = 80) -> str:
    return s if len(s) <= limit else s[: limit - 3] + "..."

