"""The bounded safetensors header reader: good headers parse, anything else is a HeaderError."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkctl.checkpoint.safetensors import (
    DTYPE_SIZE,
    Header,
    HeaderError,
    TensorKind,
    _fast_parse,
    _validate,
    encode_header,
    nbytes,
    parse_header,
    read_header,
    read_header_bytes,
)


def _file(tmp_path: Path, raw: bytes, data: int, name: str = "x.safetensors") -> Path:
    p = tmp_path / name
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * data)
    return p


def test_roundtrip_and_sizes(tmp_path: Path) -> None:
    raw, layout = encode_header({"a": ("BF16", (3, 4)), "b.mcg": ("I32", ()), "c": ("I16", (2, 2, 48))},
                                {"format": "pt"})
    assert len(raw) % 8 == 0
    h = read_header(_file(tmp_path, raw, layout["c"].end))
    assert h.tensors["a"].shape == (3, 4) and h.tensors["b.mcg"].shape == ()
    assert h.metadata == {"format": "pt"}
    assert h.data_len == 24 + 4 + 2 * 2 * 48 * 2
    assert h.file_size == 8 + len(raw) + h.data_len
    assert DTYPE_SIZE["BF16"] == 2 and nbytes("F4", (3,)) == 2


def test_slow_path_matches_fast_path() -> None:
    raw, _ = encode_header({"a": ("F16", (2, 3)), "b": ("I32", ())}, {"format": "pt"})
    spaced = json.dumps(json.loads(raw), indent=1).encode()  # not the compact form: json.loads path
    fast, slow = parse_header(raw), parse_header(spaced)
    assert fast.tensors == slow.tensors and fast.data_len == slow.data_len


@pytest.mark.parametrize(("doc", "code"), [
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
      "b": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}, "offsets-overlap"),
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}, "offsets-gap"),
    ({"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}, "tensor-bytes"),
    ({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 4]}}, "header-dtype"),
    ({"a": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}}, "header-shape"),
    ({"a": {"dtype": "F16", "shape": [True], "data_offsets": [0, 2]}}, "header-shape"),
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}, "header-offsets"),
    ({"a": [1, 2]}, "header-entry"),
    ({"__metadata__": {"k": 1}}, "header-metadata"),
    ([1, 2], "header-json"),
])
def test_bad_headers(doc: object, code: str) -> None:
    for raw in (json.dumps(doc, separators=(",", ":")).encode(), json.dumps(doc).encode()):
        with pytest.raises(HeaderError) as exc:
            parse_header(raw)
        assert exc.value.code == code


def test_length_checks(tmp_path: Path) -> None:
    p = tmp_path / "short"
    p.write_bytes(b"\1\2")
    with pytest.raises(HeaderError, match="too short") as exc:
        read_header(p)
    assert exc.value.code == "header-short"
    p.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(HeaderError) as exc:
        read_header(p)
    assert exc.value.code == "header-past-eof"
    p.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(HeaderError) as exc:
        read_header(p)
    assert exc.value.code == "header-too-large"
    with pytest.raises(HeaderError) as exc:
        read_header(tmp_path / "absent")
    assert exc.value.code == "io"


def test_100mb_garbage_header_is_rejected_from_a_prefix(tmp_path: Path) -> None:
    p = tmp_path / "garbage.safetensors"
    size = 100_000_000
    with open(p, "wb") as f:  # sparse: the length says 100 MB, the disk holds 1 MiB
        f.write(size.to_bytes(8, "little") + bytes(range(256)) * 4096)
        f.truncate(8 + size + 16)
    tracemalloc.start()
    with pytest.raises(HeaderError) as exc:
        read_header(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert exc.value.code == "header-json"
    assert peak < 1_000_000  # read a 64 KiB prefix, never the 100 MB


def test_cap_is_configurable() -> None:
    raw = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    f = io.BytesIO(len(raw).to_bytes(8, "little") + raw + b"\0")
    with pytest.raises(HeaderError) as exc:
        read_header_bytes(f, 8 + len(raw) + 1, max_header_bytes=16)
    assert exc.value.code == "header-too-large"


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                     max_leaves=20)
_entry = st.fixed_dictionaries({"dtype": st.sampled_from(["F16", "BF16", "I32", "Q", 3]),
                                "shape": st.lists(st.integers(-2, 5), max_size=3) | _json,
                                "data_offsets": st.lists(st.integers(-1, 64), min_size=0, max_size=3) | _json})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200) | _json.map(lambda d: json.dumps(d).encode())
       | st.dictionaries(st.text(max_size=5), _entry, max_size=4).map(
           lambda d: json.dumps(d, separators=(",", ":")).encode()))
def test_fuzz_parse_header_only_raises_header_error(raw: bytes) -> None:
    try:
        header = parse_header(raw)
    except HeaderError:
        return
    # Accepted only what is a JSON object, with exactly its non-metadata keys as tensors.
    doc = json.loads(raw)
    assert isinstance(doc, dict)
    assert list(header.kinds) == [k for k in doc if k != "__metadata__"]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.binary(max_size=63).map(lambda b: b"{" + b),  # often a JSON-looking start
       st.integers(0, 2**64 - 1) | st.integers(0, 130), st.binary(max_size=64),
       st.sampled_from([0, 0, 1, 40]))  # the file shrank by this much after its size was taken
def test_fuzz_read_header_bytes(prefix_tail: bytes, length: int, body: bytes, shrank: int) -> None:
    data = length.to_bytes(8, "little") + prefix_tail + body
    try:
        got = read_header_bytes(io.BytesIO(data), len(data) + shrank)
    except HeaderError:
        pass
    else:  # exactly the `length` bytes after the prefix, never more
        assert got == data[8:8 + length] and len(got) == length
    try:
        got = read_header_bytes(io.BytesIO(prefix_tail), len(prefix_tail))
    except HeaderError:
        pass
    else:
        n = int.from_bytes(prefix_tail[:8], "little")
        assert len(prefix_tail) >= 8 and got == prefix_tail[8:8 + n] and len(got) == n


# -- the column-wise fast path must accept exactly what json.loads + _validate accept, with the same result

def _slow(raw: bytes) -> object:
    try:
        return _validate(json.loads(raw), len(raw))
    except (ValueError, RecursionError, HeaderError) as exc:
        return type(exc)


def _same(raw: bytes) -> None:
    fast = _fast_parse(raw)
    if fast is not None:
        slow = _slow(raw)
        assert isinstance(slow, Header), (raw, slow)
        assert (fast.tensors, fast.metadata, fast.data_len, fast.header_len) == (
            slow.tensors, slow.metadata, slow.data_len, slow.header_len)
        assert fast.kinds == slow.kinds and list(fast.kinds) == list(slow.kinds)


def test_fast_path_takes_the_writers_form() -> None:
    raw, layout = encode_header({"a.trellis": ("I16", (4, 4, 48)), "a.suh": ("F16", (64,)), "a.mcg": ("I32", ()),
                                 "z": ("F4", (3, 2))}, {"format": "pt"})
    h = _fast_parse(raw)
    assert h is not None and h.tensors == layout and h.data_len == layout["z"].end
    assert h.kinds["a.suh"] == TensorKind("F16", (64,), 128)
    assert h.kinds["a.suh"] is not h.kinds["a.trellis"] and h.kinds["a.mcg"].nbytes == 4
    _same(raw)


@pytest.mark.parametrize("edit", [
    lambda s: s.replace('"a":', '"a\\u0062":'),                  # an escape in a name
    lambda s: s.replace('"a":', '"a\x01":'),                     # a control character (json.loads refuses it)
    lambda s: s.replace('[0,4]', '[0,04]'),                      # a leading zero (not JSON)
    lambda s: s.replace('[0,4]', '[0, 4]'),                      # a space (JSON, but not the writer's form)
    lambda s: s.replace('[0,4]', '[-0,4]'),
    lambda s: s.replace('"shape":[2]', '"shape":[2.0]'),
    lambda s: s.replace('"shape":[2]', '"shape":[+2]'),
    lambda s: s.replace('"shape":[2]', '"shape":[true]'),
    lambda s: s.replace('[0,4]', '[0,4,5]'),
    lambda s: s.replace('[0,4]', '[0]'),
    lambda s: s.replace('"F16"', '"Q7"'),
    lambda s: s.replace('"b":', '"a":'),                         # a duplicate name
    lambda s: s.replace('"b":', '"__metadata__":'),
    lambda s: s.replace('"dtype":"F16","shape":[2]', '"shape":[2],"dtype":"F16"'),  # another key order
    lambda s: s.replace('[4,8]', '[5,9]').replace('"shape":[2],"data_offsets":[8,12]', '"shape":[2],"data_offsets":[9,13]'),
    lambda s: s.replace('[0,4]', '[4,8]', 1).replace('[4,8]}', '[0,4]}', 1),  # out of file order: still valid
    lambda s: s,
])
def test_fast_path_edits_agree_with_the_slow_path(edit: Any) -> None:
    raw = edit('{"__metadata__":{"format":"pt"},"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},'
               '"b":{"dtype":"F16","shape":[2],"data_offsets":[4,8]},'
               '"c":{"dtype":"F16","shape":[2],"data_offsets":[8,12]}}').encode()
    _same(raw)
    try:
        via_parse = parse_header(raw)
    except HeaderError:
        assert not isinstance(_slow(raw), Header)
    else:
        assert via_parse == _slow(raw)


_names = st.text(alphabet=st.sampled_from(list('ab.:,{}[]"\\\x01 ') + ["é"]), max_size=6)
_num = st.sampled_from(["0", "1", "2", "4", "8", "01", "-1", "1.0", "+1", " 2", "", "1e1", "99999"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_names, st.sampled_from(["F16", "I32", "U8", "BF16", "Q", "F4"]),
                          st.lists(_num, max_size=3), _num, _num), max_size=5),
       st.booleans())
def test_fuzz_fast_path_agrees_with_slow_path(entries: list[tuple[str, str, list[str], str, str]], meta: bool) -> None:
    # Build compact text directly (not via json.dumps) so that non-JSON numbers and odd names occur.
    body = ",".join(f'"{n}":{{"dtype":"{d}","shape":[{",".join(s)}],"data_offsets":[{b},{e}]}}'
                    for n, d, s, b, e in entries)
    text = "{" + ('"__metadata__":{"format":"pt"}' + ("," if body else "") if meta else "") + body + "}"
    _same(text.encode("utf-8"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["F16", "I32", "U8", "F4", "I16"]),
                          st.lists(st.integers(0, 40), max_size=3)), min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_fuzz_valid_headers_take_the_fast_path(specs: list[tuple[str, list[int]]], rnd: Any) -> None:
    # F4 packs two per byte: a header holds only an even count of them (the reference refuses the rest).
    tensors = {f"t{i}.{rnd.choice(['trellis', 'suh', 'weight'])}": (d, (*s, 2) if d == "F4" else tuple(s))
               for i, (d, s) in enumerate(specs)}
    raw, layout = encode_header(tensors, {"format": "pt"} if rnd.random() < 0.5 else None)
    h = _fast_parse(raw)
    assert h is not None and h.tensors == layout
    _same(raw)
