"""deploy's pure parts: the inputs a plan records (secrets by presence only), what differs between two sets
of inputs, the checkpoint's digest from a scan, the saved document written whole, and build's dry run read
as "anything to do"."""

from __future__ import annotations

from pathlib import Path

from sparkctl.spec import deploy_plan as dp

SCAN = {"files": {"a.safetensors": {"size": 10}, "config.json": {"size": 2}},
        "shards": {"a.safetensors": {"size": 10, "header_sha256": "h", "head_sha256": "x", "tail_sha256": "y"}},
        "json": {"config.json": {"sha256": "c1"}}}


def test_a_secret_is_recorded_by_its_presence_only() -> None:
    view = dp.settings_view({"HF_TOKEN": "hf_secret", "TP": 4, "EMPTY": ""}, {"HF_TOKEN"})
    assert view == {"HF_TOKEN": "(set)", "TP": "4"}
    assert "hf_secret" not in str(dp.inputs(view, b"recipe", None))


def test_the_same_inputs_differ_in_nothing_and_a_knob_change_is_named() -> None:
    a = dp.inputs({"TP": "4", "GPU_MEMORY_UTILIZATION": "0.8"}, b"r", "fp1")
    assert dp.diff_inputs(a, dict(a)) == []
    b = dp.inputs({"TP": "4", "GPU_MEMORY_UTILIZATION": "0.85", "NEW": "1"}, b"r2", "fp2")
    assert dp.diff_inputs(a, b) == ["setting GPU_MEMORY_UTILIZATION: 0.8 -> 0.85", "setting NEW: (unset) -> 1",
                                    f"recipe file: {a['recipe_hash']} -> {b['recipe_hash']}",
                                    "checkpoint on the head: fp1 -> fp2"]
    assert dp.inputs_key(a) != dp.inputs_key(b)


def test_the_checkpoint_digest_follows_the_shards_and_json_and_is_none_without_one() -> None:
    fp = dp.checkpoint_fingerprint(SCAN)
    assert fp and fp == dp.checkpoint_fingerprint(dict(SCAN))
    other = {**SCAN, "shards": {"a.safetensors": {**SCAN["shards"]["a.safetensors"], "tail_sha256": "z"}}}
    assert dp.checkpoint_fingerprint(other) != fp
    assert dp.checkpoint_fingerprint({**SCAN, "json": {"config.json": {"sha256": "c2"}}}) != fp
    assert dp.checkpoint_fingerprint({"error": {"code": "dir-missing"}}) is None
    assert dp.checkpoint_fingerprint(None) is None


def test_the_saved_document_round_trips_and_a_broken_one_is_no_plan(tmp_path: Path) -> None:
    path = tmp_path / "c" / "deploy-plan.json"
    doc = dp.plan_doc("c", dp.inputs({"TP": "4"}, b"r", None), [{"step": "up", "todo": True}])
    dp.write_doc(path, doc)
    assert dp.read_doc(path) == doc
    assert [p.name for p in path.parent.iterdir()] == ["deploy-plan.json"]  # no temp file left
    path.write_text("{half")
    assert dp.read_doc(path) is None
    assert dp.read_doc(tmp_path / "absent.json") is None


def test_builds_dry_run_is_todo_only_when_a_layer_builds_or_an_image_moves() -> None:
    done = {"s1": {"steps": [{"layer": "base", "action": "skip"}, {"layer": "top", "action": "skip"}]},
            "s2": {"ship": "nothing: it has the head's image"}}
    assert dp.build_todo(done) == (False, ["s1: every layer up to date", "s2: nothing: it has the head's image"])
    todo, lines = dp.build_todo({**done, "s1": {"steps": [{"layer": "base", "action": "skip"},
                                                          {"layer": "top", "action": "build"}]}})
    assert todo and lines[0] == "s1: build 1 layer(s): top"
    assert dp.build_todo({"s1": {"image": "has sha256:abc"}, "s2": {"image": "pull: stale"}})[0]
    assert dp.build_todo({"s1": {"error": "unreachable"}})[0]
    assert dp.build_todo(done, {"stale": {"s2": "differs from the head's"}})[0]
