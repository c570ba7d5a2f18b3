"""The bounded safetensors header reader: good headers parse, anything else is a HeaderError."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkctl.safetensors import (
    DTYPE_SIZE,
    HeaderError,
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
        parse_header(raw)
    except HeaderError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=64), st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_fuzz_read_header_bytes(prefix_tail: bytes, length: int, body: bytes) -> None:
    data = length.to_bytes(8, "little") + prefix_tail + body
    try:
        read_header_bytes(io.BytesIO(data), len(data))
    except HeaderError:
        pass
    try:
        read_header_bytes(io.BytesIO(prefix_tail), len(prefix_tail))
    except HeaderError:
        pass
