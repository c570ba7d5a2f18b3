"""What `settings` promises: each knob's range to the unit, secrets never shown, unknown or doubled keys
refused where the cluster changes (what `bench/mutation.py settings` showed untested).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import UsageError
from sparkctl.spec import settings as settings_module
from sparkctl.spec.settings import (
    LEGACY_DOC,
    MAX_EXTRA_ARGS_CHARS,
    PASSTHROUGH_DOC,
    REDACTED,
    Settings,
    knob_doc,
    load_settings,
    validate_settings,
)

NODES = "spark1 spark2 spark3 spark4"
BASE = {"NODES": NODES, "MODEL": "/models/m"}

# Every bounded knob's range, written out here on purpose (not read from settings.KNOBS): (lowest, highest), None
# where there is no bound. A value at a bound is taken; one step past it is refused, naming the bound.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "TP": (1, 1024), "DCP": (1, 1024), "GPUS_PER_NODE": (1, 64), "REPLICAS": (1, 1024),
    "MAX_MODEL_LEN": (1, 100_000_000), "MAX_FULL_SEQS": (1, 4096), "GPU_MEMORY_UTILIZATION": (0.01, 1.0),
    "KV_CACHE_MEMORY_BYTES": (1, None), "NODE_MEMORY_BYTES": (1, None), "PORT": (1, 65535),
    "MASTER_PORT": (1, 65535), "SPEC_K": (1, 16), "ULIMIT_NOFILE": (1024, None), "ULIMIT_MEMLOCK": (-1, None),
    "ABLIT": (0, 1), "BUILD_KEEP_CHAINS": (1, 100), "WATCH_INTERVAL_S": (0.2, 3600),
    "WATCH_CANARY_S": (0.2, 86400), "WATCH_CANARY_TIMEOUT_S": (0.5, 3600), "WATCH_MAX_RESTARTS": (0, 1000),
    "WATCH_RESTART_WINDOW_S": (1, 10**7), "WATCH_BACKOFF_S": (0, 86400), "WATCH_NODE_WAIT_S": (0, 10**6),
    "WATCH_READY_TIMEOUT_S": (1, 10**6), "MEMORY_WAIT_S": (0, 3600),
}
FLOATS = {"GPU_MEMORY_UTILIZATION", "WATCH_INTERVAL_S", "WATCH_CANARY_S", "WATCH_CANARY_TIMEOUT_S",
          "WATCH_RESTART_WINDOW_S", "WATCH_BACKOFF_S", "WATCH_NODE_WAIT_S", "WATCH_READY_TIMEOUT_S", "MEMORY_WAIT_S"}


def _load(extra: dict[str, str] | None = None, **kw: Any) -> Settings:
    return load_settings(cli={}, environ={**BASE, **(extra or {})}, **kw)


def _range_lines(key: str, value: str) -> list[str]:
    """The lines of the refusal that say `key` is out of its range (none when the value is taken)."""
    try:
        _load({key: value})
    except UsageError as exc:
        return [ln for ln in exc.message.splitlines()
                if ln.startswith(f"{key}=") and ("must be at least" in ln or "must be at most" in ln)]
    return []


def _text(key: str, v: float) -> str:
    return repr(float(v)) if key in FLOATS else str(int(v))


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_knob_takes_its_whole_range_and_not_one_step_more(clean_env: Any, key: str) -> None:
    lo, hi = RANGES[key]
    step = 0.001 if key in FLOATS else 1
    if lo is not None:
        assert _range_lines(key, _text(key, lo)) == []
        below = _range_lines(key, _text(key, lo - step))
        assert len(below) == 1 and below[0].endswith(f"must be at least {lo:g}"), below
    if hi is not None:
        assert _range_lines(key, _text(key, hi)) == []
        above = _range_lines(key, _text(key, hi + step))
        assert len(above) == 1 and above[0].endswith(f"must be at most {hi:g}"), above


def test_vllm_extra_args_take_8192_characters_and_not_one_more(clean_env: Any) -> None:
    assert MAX_EXTRA_ARGS_CHARS == 8192
    def padded(n: int) -> str:  # the value is stripped when read: the padding goes between the words
        return "--dtype" + " " * (n - len("--dtype") - len("auto")) + "auto"

    assert _load({"VLLM_EXTRA_ARGS": padded(8192)}).vllm_extra_args() == ["--dtype", "auto"]
    with pytest.raises(UsageError) as exc:
        _load({"VLLM_EXTRA_ARGS": padded(8193)})
    assert "VLLM_EXTRA_ARGS" in exc.value.message and "longer than 8192 characters" in exc.value.message


def test_a_replica_that_does_not_exist_is_refused_naming_those_that_do(clean_env: Any) -> None:
    s = _load({"TP": "2", "DCP": "2"})  # 4 nodes, TP 2: replicas 0 and 1
    assert [r.nodes for r in s.replicas()] == [["spark1", "spark2"], ["spark3", "spark4"]]
    for index in (2, -1):
        with pytest.raises(UsageError) as exc:
            s.replica(index)
        assert exc.value.message.startswith(f"replica {index} does not exist: there are 2 (0..1; REPLICAS")


def test_each_key_pattern_has_its_doc_and_an_unknown_key_none() -> None:
    assert knob_doc("TP") is not None and "Tensor-parallel" in (knob_doc("TP") or "")
    assert "GID index of the n-th node" in (knob_doc("RANK3_GID_INDEX") or "")
    assert knob_doc("STANDIN_CRASH_AFTER", ("STANDIN_",)) == knob_doc("NCCL_DEBUG", ("X_", "NCCL_")) == PASSTHROUGH_DOC
    assert knob_doc("STANDIN_CRASH_AFTER") is None and knob_doc("SKIP_X") == LEGACY_DOC
    assert knob_doc("MAX_MODEL_LENGTH") is None and knob_doc("RANK1_NOPE") is None


def test_a_key_set_twice_is_refused_where_the_cluster_changes_and_warned_elsewhere(clean_env: Any,
                                                                                      tmp_path: Path) -> None:
    env = tmp_path / "cluster.env"
    env.write_text("NODES=spark1 spark2 spark3 spark4\nMODEL=/models/m\nPORT=9000\nTP=4\nPORT=9100\n")
    s = load_settings(env_file=str(env), cli={}, environ={})
    assert s.getint("PORT") == 9100
    assert s.warnings == [f"PORT is set 2 times in env file {env} (lines 3, 5): the last one is used"]
    with pytest.raises(UsageError) as exc:
        load_settings(env_file=str(env), cli={}, environ={}, strict_keys=True)
    assert exc.value.message == f"PORT is set 2 times in env file {env} (lines 3, 5)"


def test_config_shows_every_value_as_read_and_only_secrets_redacted(clean_env: Any) -> None:
    s = _load({"HF_TOKEN": "hf_abc", "PORT": "9000"})
    shown = s.as_dict()
    assert shown["PORT"] == {"value": 9000, "source": "environment"}
    assert shown["NODES"]["value"] == NODES.split() and shown["GPU_MEMORY_UTILIZATION"]["value"] == 0.8
    assert shown["HF_TOKEN"] == {"value": REDACTED, "source": "environment"}
    assert s.as_dict(redact=False)["HF_TOKEN"]["value"] == "hf_abc"


def test_a_gid_index_that_is_not_a_number_is_refused_by_name(clean_env: Any) -> None:
    with pytest.raises(UsageError) as exc:
        _load({"RANK1_GID_INDEX": "three"})
    assert exc.value.message == "RANK1_GID_INDEX='three' (from environment) must be a whole number"
    assert _load({"RANK1_GID_INDEX": "7"}).as_dict()["RANK1_GID_INDEX"]["value"] == 7


def test_a_replica_view_is_only_itself(clean_env: Any) -> None:
    view = _load({"TP": "2", "DCP": "2"}).replica(1)
    assert view.replica(0) is view and view.nodes == ["spark3", "spark4"]
    with pytest.raises(UsageError) as exc:
        view.replica(1)
    assert exc.value.message == "replica 1 of a replica view (it is replica 1)"


def test_a_fabric_subnet_may_be_written_with_a_host_address(clean_env: Any) -> None:
    assert _load({"FABRIC_SUBNET": "192.168.100.7/24"}).get("FABRIC_SUBNET") == "192.168.100.7/24"


def test_a_replicas_pins_are_the_knobs_at_its_nodes_positions(clean_env: Any) -> None:
    """TP 3 on 6 nodes: replica 1 is spark4..spark6, its rank 1 the fifth node, so RANK4_*."""
    nodes = "spark1 spark2 spark3 spark4 spark5 spark6"
    view = load_settings(cli={}, environ={"NODES": nodes, "MODEL": "/models/m", "TP": "3", "DCP": "1",
                                          "RANK4_FABRIC_IP": "10.0.0.5", "RANK4_GID_INDEX": "5"}).replica(1)
    assert view.rank_key(1, "FABRIC_IP") == "RANK4_FABRIC_IP"
    assert (view.rank_pins(1).fabric_ip, view.rank_pins(1).gid_index) == ("10.0.0.5", 5)


def test_a_pvc_model_volume_is_taken_by_its_claim_name(clean_env: Any) -> None:
    assert _load({"LWS_MODEL_VOLUME": "pvc:glm-models"}).get("LWS_MODEL_VOLUME") == "pvc:glm-models"
    with pytest.raises(UsageError, match="must be hostpath or pvc:<claim>"):
        _load({"LWS_MODEL_VOLUME": "pvc:Bad_Claim"})


def test_a_recipe_without_gpus_per_node_plans_one_gpu_per_node(clean_env: Any, tmp_path: Path) -> None:
    import sparkctl

    shipped = Path(sparkctl.__file__).parent / "recipes" / "lab.toml"
    mine = tmp_path / "mine.toml"
    mine.write_text("".join(ln for ln in shipped.read_text().splitlines(keepends=True)
                            if not ln.startswith("GPUS_PER_NODE")))
    s = _load({"RECIPE": str(mine)})
    assert s.get("GPUS_PER_NODE") is None
    assert [list(r.nodes) for r in s.topology.replicas] == [NODES.split()]


# ---- CONTAINER_ENV_PREFIXES: what passes into the containers as it is ------------------------------------

def _passing(tmp_path: Path, lines: str, **environ: str) -> Settings:
    env = tmp_path / "c.env"
    env.write_text('NODES="a b c d"\nMODEL=/m\n' + lines)
    return load_settings(env_file=str(env), cli={}, environ=environ, validate=False)


def test_only_a_declared_family_passes_to_the_containers(clean_env: Any, tmp_path: Path) -> None:
    plain = _passing(tmp_path, "STANDIN_TTFT_S=0.3\nSKIP_PULL=1\n")
    assert plain.passthrough_env() == {}
    assert any("unknown key STANDIN_TTFT_S" in w for w in plain.warnings)
    assert not any("SKIP_PULL" in w for w in plain.warnings)  # the bash launcher's switch: accepted, not passed
    declared = _passing(tmp_path, "CONTAINER_ENV_PREFIXES=STANDIN_ NCCL_\nSTANDIN_TTFT_S=0.3\nNCCL_DEBUG=INFO\n"
                                  "SKIP_PULL=1\n")
    assert declared.passthrough_env() == {"STANDIN_TTFT_S": "0.3", "NCCL_DEBUG": "INFO"}
    assert declared.warnings == []
    from_environment = _passing(tmp_path, "", CONTAINER_ENV_PREFIXES="NCCL_", NCCL_ALGO="Ring", STANDIN_X="1")
    assert from_environment.passthrough_env() == {"NCCL_ALGO": "Ring"}


def test_the_lab_recipe_declares_the_stand_ins_family(clean_env: Any, tmp_path: Path) -> None:
    s = _passing(tmp_path, "RECIPE=lab\nSTANDIN_LOAD_DELAY_S=0\n", STANDIN_TTFT_S="0.1")
    assert s.passthrough_env() == {"STANDIN_LOAD_DELAY_S": "0", "STANDIN_TTFT_S": "0.1"}
    # The product names no family of the lab's: the recipe declares it (settings.py says nothing of the stand-in).
    assert "STANDIN" not in Path(settings_module.__file__).read_text().upper().replace("-", "")


def test_a_knob_never_passes_and_a_bad_prefix_is_refused(clean_env: Any, tmp_path: Path) -> None:
    s = _passing(tmp_path, "CONTAINER_ENV_PREFIXES=MAX_ RANK0_\nMAX_MODEL_LEN=4096\nRANK0_FABRIC_IP=10.0.0.1\n"
                           "MAX_JOBS=2\n")
    assert s.passthrough_env() == {"MAX_JOBS": "2"}
    with pytest.raises(UsageError, match="CONTAINER_ENV_PREFIXES"):
        validate_settings(_passing(tmp_path, "CONTAINER_ENV_PREFIXES=nccl\n"))


@pytest.mark.parametrize("key", ["DCP", "MAX_MODEL_LEN", "KV_CACHE_DTYPE", "GPU_MEMORY_UTILIZATION", "IMAGE"])
def test_a_blank_knob_the_recipe_sets_is_refused_naming_the_line_and_the_default(tmp_path: Path, key: str) -> None:
    """`DCP=` in an env file hid the recipe's DCP=4: the planner read None and crashed ("internal error:
    TypeError"); `KV_CACHE_DTYPE=` planned a cache of dtype "None". A blank now stops with one line."""
    env = tmp_path / "cluster.env"
    env.write_text(f"NODES={NODES}\nMODEL=/models/m\n{key}=\n")
    default = load_settings(cli={}, environ=BASE).recipe.defaults[key]
    with pytest.raises(UsageError) as err:
        load_settings(env_file=str(env), cli={}, environ={})
    assert err.value.message == (f"{key} is blank (from env file {env}), which would hide recipe glm53-exl3-tp4's "
                                 f"{key}={default}: delete the line to use it, or give a value")
    with pytest.raises(UsageError, match=f"{key} is blank \\(from environment\\).*: unset it to use it"):
        load_settings(cli={}, environ={**BASE, key: " "})


def test_a_blank_knob_the_recipe_leaves_unset_or_a_blank_list_is_simply_unset(tmp_path: Path) -> None:
    env = tmp_path / "cluster.env"
    env.write_text(f"NODES={NODES}\nMODEL=/models/m\nKV_CACHE_MEMORY_BYTES=\nCONTAINER_ENV_PREFIXES=\n")
    s = load_settings(env_file=str(env), cli={}, environ={})
    assert s.get("KV_CACHE_MEMORY_BYTES") is None and s.container_env_prefixes() == ()
    assert s.getint("DCP") == 4
