"""The checkpoint reader the planner relies on, at its edges (what its mutation run,
bench/mutation.py, showed untested).

checkpoint_from_scan turns a checkpoint scan (probes/ckpt_scan.py: this machine's, or what a node printed)
into the planner's input. A node's answer is untrusted: anything malformed is a UsageError or CheckFailed
naming the node and the file, never another exception. Each test here was seen red on the mutants it names
in docs/mutations.md (issue-32p)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import CheckFailed, SparkctlError, UsageError
from sparkctl.probes import ckpt_scan
from sparkctl.probes.ckpt_scan import scan
from sparkctl.spec import planner as P
from tests.conftest import GLM53_CONFIG, write_model

INDEX = P.INDEX_NAME
NODE = "spark1"
PIB = 1 << 50


def _node_scan(model: Path, headers: str = "summary") -> dict[str, Any]:
    """What a node prints for `sparkctl check` (the planner's scan: no shard headers)."""
    return scan(str(model), headers=headers, shards=False, summary_cache="")


def _model(tmp_path: Path, shards: int = 3) -> Path:
    return write_model(tmp_path / "m", 3000, shards)


def _refused(doc: Any, model: Path, kind: type[SparkctlError] = UsageError) -> SparkctlError:
    """checkpoint_from_scan refuses `doc` as `kind` (exactly), and says which node."""
    with pytest.raises(SparkctlError) as caught:
        P.checkpoint_from_scan(doc, model, NODE)
    assert type(caught.value) is kind, caught.value
    assert f" on {NODE}" in caught.value.message
    return caught.value


# ------------------------------------------------------------------ the scan's own error


def test_a_missing_model_folder_is_a_usage_error_that_says_where_to_point_model(tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    err = _refused(_node_scan(nowhere), nowhere)
    assert err.message == f"MODEL={nowhere} is not a folder on {NODE}"
    assert err.fix == "point MODEL at the checkpoint folder, at the same path on every node"


@pytest.mark.parametrize("error", [
    {"code": "io", "message": "cannot read: Permission denied"},  # a code sorting after dir-missing
    {"code": "denied", "message": "cannot read: Permission denied"},  # one sorting before it
    {"message": "cannot read: Permission denied"},  # no code at all
    "cannot read: Permission denied",  # an older node: the error as a bare string
])
def test_any_other_scan_error_is_a_check_failure_carrying_the_nodes_message(error: Any) -> None:
    """Only dir-missing is the user's MODEL; any other error the node reports is shown as the node said it
    (the message, not the dict around it), as a CheckFailed naming the node."""
    err = _refused({"error": error}, Path("/m"), CheckFailed)
    assert err.message == f"cannot read the checkpoint on {NODE}: cannot read: Permission denied"


# ------------------------------------------------------------------ the answer's shape


@pytest.mark.parametrize("part", ["json", "files"])
@pytest.mark.parametrize("bad", [None, [], "x"])
def test_json_or_files_not_an_object_is_refused_even_when_the_other_is(tmp_path: Path, part: str, bad: Any) -> None:
    m = _model(tmp_path)
    doc = _node_scan(m)
    doc[part] = bad
    assert "json/files are not objects" in _refused(doc, m, CheckFailed).message


def test_a_scan_without_a_config_entry_is_the_usage_error_for_a_folder_without_config(tmp_path: Path) -> None:
    """A scan that names no config.json at all (not even {"missing": true}) means the same as a folder
    without one: MODEL is not the checkpoint folder."""
    m = _model(tmp_path)
    doc = _node_scan(m)
    del doc["json"]["config.json"]
    err = _refused(doc, m)
    assert err.message == f"config.json not found in {m} on {NODE}"
    assert err.fix == "MODEL must be the checkpoint folder itself"


def test_a_scan_without_an_index_entry_lists_the_folders_shards(tmp_path: Path) -> None:
    m = _model(tmp_path)
    doc = _node_scan(m)
    del doc["json"][INDEX]
    info = P.checkpoint_from_scan(doc, m, NODE)
    assert [s.name for s in info.shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert info.shard_bytes == 3000 and info.index_total_size is None


def test_a_folder_without_an_index_is_planned_from_its_safetensors_files(tmp_path: Path) -> None:
    m = _model(tmp_path)
    (m / INDEX).unlink()
    (m / "serving").mkdir()
    (m / "serving" / "extra.safetensors").write_bytes(b"x")  # one folder down: not a shard of the model
    info = P.checkpoint_from_scan(_node_scan(m), m, NODE)
    assert [(s.name, s.size) for s in info.shards] == [
        ("model-00001-of-00003.safetensors", 1000), ("model-00002-of-00003.safetensors", 1000),
        ("model-00003-of-00003.safetensors", 1000)]
    for shard in m.glob("*.safetensors"):
        shard.unlink()
    err = _refused(_node_scan(m), m)
    assert err.message == f"{m} on {NODE}: no {INDEX} and no *.safetensors files"


# ------------------------------------------------------------------ config.json and the index, file by file


def test_a_json_file_the_node_could_not_read_names_the_file_and_the_node(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan refuses a JSON file above its cap (ckpt_scan.MAX_JSON_BYTES, the only cap: planner.py had a
    second, 64 MiB, that nothing read); the planner passes that on as the user's file, on that node."""
    m = _model(tmp_path)
    monkeypatch.setattr(ckpt_scan, "MAX_JSON_BYTES", 100)
    (m / "config.json").write_text('{"pad": "' + "x" * 200 + '"}')
    err = _refused(_node_scan(m), m)
    assert err.message.startswith(f"{m / 'config.json'} on {NODE}: ") and "json-too-large" in err.message
    doc = _node_scan(m)
    doc["json"]["config.json"] = {"error": "cannot read: Input/output error"}
    assert _refused(doc, m).message == f"{m / 'config.json'} on {NODE}: cannot read: Input/output error"


@pytest.mark.parametrize("text", ["[1, 2]", "42", '"a string"'])
def test_a_config_that_is_json_but_not_an_object_names_the_file(tmp_path: Path, text: str) -> None:
    m = _model(tmp_path)
    (m / "config.json").write_text(text)
    assert _refused(_node_scan(m), m).message == f"{m / 'config.json'} on {NODE}: expected a JSON object"


@pytest.mark.parametrize("summary", [{"weight_map": False, "shards": {}}, {"shards": {"a.safetensors": {}}},
                                     {"weight_map": True, "shards": []},
                                     {"weight_map": True, "shards": {}, "error": "not valid JSON"}])
def test_a_summarised_index_without_a_weight_map_names_the_index(tmp_path: Path, summary: dict[str, Any]) -> None:
    m = _model(tmp_path)
    doc = _node_scan(m)
    assert isinstance(doc["json"][INDEX].get("summary"), dict)  # what a node sends in summary mode
    doc["json"][INDEX] = {"summary": summary}
    assert _refused(doc, m).message == f"{m / INDEX} on {NODE}: has no weight_map object of tensor → shard names"


def test_an_index_sent_whole_gives_its_shards_and_its_total(tmp_path: Path) -> None:
    """A node scanning in zlib mode sends the index itself, not its summary: the same shards, and the
    index's metadata.total_size."""
    m = _model(tmp_path)
    doc = _node_scan(m, headers="zlib")
    assert "data" in doc["json"][INDEX] and "summary" not in doc["json"][INDEX]
    info = P.checkpoint_from_scan(doc, m, NODE)
    assert info == P.checkpoint_from_scan(_node_scan(m), m, NODE)
    assert info.index_total_size == 3000 and len(info.shards) == 3


@pytest.mark.parametrize("index", ['{"weight_map": ["a.safetensors"]}', '{"metadata": {}}', "[1]", "7"])
def test_an_index_sent_whole_without_a_weight_map_names_the_index(tmp_path: Path, index: str) -> None:
    m = _model(tmp_path)
    (m / INDEX).write_text(index)
    assert _refused(_node_scan(m, headers="zlib"), m).message == f"{m / INDEX} on {NODE}: has no weight_map object"


@pytest.mark.parametrize("name", ["../../etc/passwd", "sub/model.safetensors", ".hidden.safetensors"])
@pytest.mark.parametrize("headers", ["summary", "zlib"])
def test_a_shard_name_must_be_a_plain_file_name(tmp_path: Path, name: str, headers: str) -> None:
    m = _model(tmp_path)
    (m / INDEX).write_text(f'{{"weight_map": {{"t": "{name}"}}}}')
    err = _refused(_node_scan(m, headers=headers), m)
    assert err.message == f"{m / INDEX} on {NODE}: shard name {name!r} must be a plain file name"


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize("size", [0, 1, PIB])
def test_a_shard_size_from_zero_to_one_pib_is_taken(tmp_path: Path, size: int) -> None:
    m = _model(tmp_path)
    doc = _node_scan(m)
    doc["files"]["model-00002-of-00003.safetensors"]["size"] = size
    info = P.checkpoint_from_scan(doc, m, NODE)
    assert [s.size for s in info.shards] == [1000, size, 1000] and info.shard_bytes == 2000 + size


@pytest.mark.parametrize("size", [-1, PIB + 1, 10**30, True, False, "12", 12.0, [12]])
def test_a_shard_size_outside_zero_to_one_pib_or_not_an_int_is_refused(tmp_path: Path, size: Any) -> None:
    """A node's listing with a size no file has (negative, above 1 PiB, a bool, text) is refused as a bad
    answer from that node, naming the file."""
    m = _model(tmp_path)
    doc = _node_scan(m)
    doc["files"]["model-00002-of-00003.safetensors"]["size"] = size
    err = _refused(doc, m, CheckFailed)
    assert err.message == (f"unexpected answer reading the checkpoint on {NODE}: size of "
                           f"'model-00002-of-00003.safetensors' is {str(size)!r}, not a byte count")


def test_a_shard_the_folder_lacks_is_missing_and_adds_no_bytes(tmp_path: Path) -> None:
    m = _model(tmp_path)
    (m / "model-00002-of-00003.safetensors").unlink()
    info = P.checkpoint_from_scan(_node_scan(m), m, NODE)
    assert info.missing == ["model-00002-of-00003.safetensors"]
    assert info.shard_bytes == 2000 and info.index_total_size == 3000


@pytest.mark.parametrize(("total", "taken"), [
    (0, 0), (1, 1), (1 << 56, 1 << 56),  # up to 64 PiB: a plausible checkpoint
    ((1 << 56) + 1, None), (-1, None), (-(1 << 56), None), (True, None), ("3000", None), (3000.0, None)])
@pytest.mark.parametrize("headers", ["summary", "zlib"])
def test_the_index_total_is_used_only_when_it_is_a_plausible_byte_count(tmp_path: Path, total: Any,
                                                                       taken: int | None, headers: str) -> None:
    m = _model(tmp_path)
    doc = _node_scan(m, headers=headers)
    if headers == "summary":
        doc["json"][INDEX]["summary"]["total_size"] = total
    else:
        import json

        index = {"metadata": {"total_size": total}, "weight_map": {"t": "model-00001-of-00003.safetensors"}}
        (m / INDEX).write_text(json.dumps(index))
        doc = _node_scan(m, headers=headers)
    info = P.checkpoint_from_scan(doc, m, NODE)
    assert info.index_total_size == taken and type(info.index_total_size) is type(taken)


# ------------------------------------------------------------------ this machine's reading


def test_reading_a_checkpoint_here_opens_no_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner needs config.json, the index and the sizes: read_checkpoint lists the shards, it
    never reads their headers (a 300 GB checkpoint on a slow disk is planned in a blink). Three shards:
    fewer than ckpt_scan's worker pool starts for, so a header read would happen in this process."""
    m = _model(tmp_path)
    read: list[str] = []

    def spy(path: str, **kw: Any) -> dict[str, Any]:
        read.append(path)
        return {}

    monkeypatch.setattr(ckpt_scan, "scan_shard", spy)
    info = P.read_checkpoint(m)
    assert len(info.shards) == 3 and info.shard_bytes == 3000
    assert read == []


def test_reading_the_drafter_opens_none_of_its_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC_METHOD=dspark: the drafter's config.json is read with the checkpoint, its shards are not opened
    either."""
    m, drafter = _model(tmp_path), write_model(tmp_path / "drafter", 300, 3)
    read: list[str] = []

    def spy(path: str, **kw: Any) -> dict[str, Any]:
        read.append(path)
        return {}

    monkeypatch.setattr(ckpt_scan, "scan_shard", spy)
    info = P.read_checkpoint(m, drafter)
    assert info.drafter_config is not None and info.drafter_config["num_hidden_layers"] > 0
    assert read == []


def test_a_checkpoints_description_is_immutable(tmp_path: Path) -> None:
    """What was validated stays validated: no shard of a CheckpointInfo can be given another size."""
    info = P.read_checkpoint(_model(tmp_path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.shards[0].size = -1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.index_total_size = None  # type: ignore[misc]


# ------------------------------------------------------------------ the KV dtype tables


def test_every_fp8_kv_dtype_is_one_byte_per_element() -> None:
    """fp8, fp8_e4m3, fp8_e5m2 and fp8_inc: the latent is kv_lora_rank + rope = 576 bytes per token per layer."""
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"):
        latent = P.kv_terms(GLM53_CONFIG, dtype, 1, Path("/m"))[0]
        assert latent.bytes_per_token_per_layer == 576, dtype


@pytest.mark.parametrize(("torch_dtype", "width"), [("bfloat16", 2), ("float16", 2), ("float32", 4)])
def test_an_auto_kv_cache_takes_the_models_dtype_width(torch_dtype: str, width: int) -> None:
    config = {**GLM53_CONFIG, "torch_dtype": torch_dtype}
    latent = P.kv_terms(config, "auto", 1, Path("/m"))[0]
    assert latent.bytes_per_token_per_layer == 576 * width
