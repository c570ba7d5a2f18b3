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
from functools import partial
from itertools import accumulate
from operator import itemgetter, sub
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
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
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


class TensorKind(NamedTuple):
    """What a tensor is, without where it lies: one object shared by every tensor of that dtype+shape."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Header:
    """A validated header.

    `kinds` (name -> TensorKind, in file order) is what the checks read; `tensors` (name ->
    TensorInfo, with offsets) is built on first use. The offsets are validated either way, but
    header-level verification of a 232k-tensor pack never looks at them again, and building 232k
    TensorInfo objects it does not need would cost a tenth of its time budget.
    """

    __slots__ = ("_ends", "_tensors", "data_len", "header_len", "kinds", "metadata")

    def __init__(self, header_len: int, tensors: dict[str, TensorInfo], metadata: dict[str, str],
                 data_len: int) -> None:
        self.header_len = header_len
        self.metadata = metadata
        self.data_len = data_len  # end of the last tensor = the data region's size the file must have
        self._tensors: dict[str, TensorInfo] | None = tensors
        self._ends: list[int] = []
        shared: dict[tuple[str, tuple[int, ...]], TensorKind] = {}
        self.kinds: dict[str, TensorKind] = {}
        for name, t in tensors.items():
            kind = shared.get((t.dtype, t.shape))
            if kind is None:
                kind = shared[(t.dtype, t.shape)] = TensorKind(t.dtype, t.shape, t.end - t.begin)
            self.kinds[name] = kind

    @classmethod
    def _tiled(cls, header_len: int, kinds: dict[str, TensorKind], metadata: dict[str, str],
               ends: list[int]) -> Header:
        """A header whose tensors lie back to back in file order, ending at `ends` (checked by the caller)."""
        self = cls.__new__(cls)
        self.header_len, self.kinds, self.metadata = header_len, kinds, metadata
        self.data_len = ends[-1] if ends else 0
        self._ends, self._tensors = ends, None
        return self

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        if self._tensors is None:
            kinds, ends = self.kinds.values(), self._ends
            infos = map(_new_info, zip(map(itemgetter(0), kinds), map(itemgetter(1), kinds), [0, *ends[:-1]], ends,
                                       strict=True))
            self._tensors = dict(zip(self.kinds, infos, strict=True))
        return self._tensors

    @property
    def file_size(self) -> int:
        """The exact size a file with this header must have."""
        return 8 + self.header_len + self.data_len

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Header):
            return NotImplemented
        return (self.header_len, self.metadata, self.data_len, self.tensors) == (
            other.header_len, other.metadata, other.data_len, other.tensors)

    __hash__ = None  # type: ignore[assignment]  # mutable contents, like the dicts it holds

    def __repr__(self) -> str:
        return (f"Header(header_len={self.header_len}, tensors=<{len(self.kinds)}>, metadata={self.metadata!r}, "
                f"data_len={self.data_len})")


_new_info = partial(tuple.__new__, TensorInfo)  # a TensorInfo from a 4-tuple, with no Python frame


def _count(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes a tensor of `dtype` and `shape` occupies (packed for sub-byte dtypes).

    A header may only hold a packed tensor that fills whole bytes (its bits a multiple of 8), as the
    reference implementation insists; nbytes rounds up for the others, which no valid header holds.
    """
    return (_count(shape) * DTYPE_BITS[dtype] + 7) // 8


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
        if b"\\" in raw:
            try:  # JSON may escape a lone surrogate ("\\ud800"), which json.loads takes and no reader can
                json.dumps(doc, ensure_ascii=False).encode()
            except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
                raise HeaderError("header-json", "header holds a string that is not valid Unicode "
                                                 "(a lone surrogate escape)") from None
        return _validate(doc, len(raw))
    finally:
        if enabled:
            gc.enable()


# The reference writer emits compact JSON with a fixed key order:
#     {"__metadata__":{...},"NAME":{"dtype":"D","shape":[S],"data_offsets":[B,E]},"NAME":{...}}
# verify-model has well under a second for 232k tensors, and anything that runs Python code per
# tensor (json.loads + checks, or a regex plus a loop) spends most of it. So that form is read
# column-wise, with a fixed number of C-level passes (split, slicing, map) and Python code only per
# distinct (dtype, shape):
#   - with no escapes and no control characters in the text, every '"' delimits a JSON string, so
#     one split on '"' cuts each entry into the same 10 pieces: name, ':{', 'dtype', ':', D, ',',
#     'shape', ':[S],', 'data_offsets', ':[B,E]},' (the body gets a trailing ',' for the last one);
#   - the six constant pieces are checked in bulk, S per distinct value, and the offsets pieces,
#     joined by '"', by one anchored regex (so each piece is exactly ':[int,int]},');
#   - the entries tile the data region in file order iff each begin is the previous end (compared
#     as canonical digit strings) and the ends are the running sum of the sizes.
# Anything else goes through json.loads and _validate, which give the precise finding: the fast
# path only ever accepts what the slow path accepts, with the same result (tests compare the two).
_ESCAPES_AND_CONTROLS = bytes(range(32)) + b"\\"
_INT = r"(?:0|[1-9][0-9]*)"
_SHAPE = re.compile(r":\[((?:" + _INT + r"(?:," + _INT + r")*)?)\],")
_OFFSETS = re.compile(r'(?::\[' + _INT + "," + _INT + r'\]\},")*')


class _Kinds(dict[tuple[str, str], TensorKind]):
    """(dtype, shape text) -> TensorKind, computed on first sight; raises ValueError if invalid."""

    def __missing__(self, key: tuple[str, str]) -> TensorKind:
        dtype, shape_s = key
        m = _SHAPE.fullmatch(shape_s)
        if dtype not in DTYPE_BITS or m is None or shape_s.count(",") > MAX_DIMS:
            raise ValueError(key)
        shape = tuple(map(int, m[1].split(","))) if m[1] else ()  # ValueError past int()'s digit limit
        if _count(shape) * DTYPE_BITS[dtype] % 8:
            raise ValueError(key)  # a packed tensor that ends inside a byte: the slow path's finding
        kind = self[key] = TensorKind(dtype, shape, nbytes(dtype, shape))
        return kind


def _fast_parse(raw: bytes) -> Header | None:
    """The compact writer's header, parsed column-wise; None when it is anything else."""
    if not raw.isascii() or len(raw.translate(None, _ESCAPES_AND_CONTROLS)) != len(raw):
        return None
    text = raw.decode("ascii").rstrip(" ")
    if not (text.startswith('{"') and text.endswith("]}}")):
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
            return None
        metadata, body = meta, body[end + 1:]
    pieces = (body + ",").split('"')
    n = len(pieces) // 10
    if (len(pieces) != 10 * n + 1 or pieces[0] or pieces[2::10].count(":{") != n
            or pieces[3::10].count("dtype") != n or pieces[4::10].count(":") != n or pieces[6::10].count(",") != n
            or pieces[7::10].count("shape") != n or pieces[9::10].count("data_offsets") != n):
        return None
    names, offsets = pieces[1::10], '"'.join(pieces[10::10]) + '"'
    try:
        kinds = list(map(_Kinds().__getitem__, zip(pieces[5::10], pieces[8::10], strict=True)))
    except ValueError:
        return None
    del pieces
    if _OFFSETS.fullmatch(offsets) is None:
        return None
    numbers = offsets[2:-4].replace(']},":[', ",").split(",")
    begins_s, ends_s = numbers[0::2], numbers[1::2]
    ends = list(map(int, ends_s))  # canonical digit strings (the regex): never raises
    if begins_s[0] == "0" and begins_s[1:] == ends_s[:-1]:
        # In file order, each begin is the previous end; then "every tensor has its size, no
        # overlap, no hole" is "the ends are the running sum of the sizes".
        if list(accumulate(map(itemgetter(2), kinds))) != ends:
            return None
        by_name = dict(zip(names, kinds, strict=True))
        if len(by_name) != n or "__metadata__" in by_name:
            return None  # duplicate names: the slow path decides what they mean
        return Header._tiled(len(raw), by_name, metadata, ends)
    # Not in file order (legal, but no writer does it): per-tensor sizes, then the general tiling check.
    begins = list(map(int, begins_s))
    if list(map(sub, ends, begins)) != list(map(itemgetter(2), kinds)):
        return None
    tensors = dict(zip(names, map(_new_info, zip(map(itemgetter(0), kinds), map(itemgetter(1), kinds),
                                                 begins, ends, strict=True)), strict=True))
    if len(tensors) != n or "__metadata__" in tensors:
        return None
    try:
        data_len = _check_tiling(list(zip(begins, ends, names, strict=True)))
    except HeaderError:
        return None  # the slow path reports it, from the parsed JSON like every other finding
    return Header(len(raw), tensors, metadata, data_len)


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
        if n * bits[dtype] & 7:
            raise HeaderError("tensor-bytes", f"tensor {name}: {dtype}{shape} is {n * bits[dtype]} bits, not a "
                                              "whole number of bytes (the safetensors reference refuses it)")
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

