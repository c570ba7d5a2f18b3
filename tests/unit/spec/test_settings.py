from __future__ import annotations

from pathlib import Path

import pytest

from sparkctl.errors import UsageError
from sparkctl.spec.resources import recipes_dir
from sparkctl.spec.settings import REDACTED, load_settings

NODES = "spark1 spark2 spark3 spark4"


def load(env_file: Path | None = None, cli: dict[str, str] | None = None, environ: dict[str, str] | None = None):
    return load_settings(env_file=str(env_file) if env_file else None, cli=cli or {}, environ=environ or {})


def test_minimal_input_is_nodes_and_model(clean_env, model_308):
    s = load(environ={"NODES": NODES, "MODEL": str(model_308)})
    assert s.nodes == NODES.split()
    assert s.model == model_308
    assert s.recipe.name == "glm53-exl3-tp4"
    assert s.getint("TP") == 4 and s.getint("DCP") == 4
    assert s.source("TP") == "recipe glm53-exl3-tp4"
    assert s.source("NODES") == "environment"


def test_precedence_recipe_envfile_environment_cli(clean_env, tmp_path, model_308):
    env = tmp_path / "cluster.env"
    env.write_text(f'NODES="{NODES}"\nMODEL={model_308}\nPORT=9000\nMAX_MODEL_LEN=2000\nMASTER_PORT=30000\n')
    s = load(env, cli={"MODEL": str(model_308)}, environ={"PORT": "9100", "MODEL": "/elsewhere"})
    assert s.getint("MAX_MODEL_LEN") == 2000 and s.source("MAX_MODEL_LEN") == f"env file {env}"
    assert s.getint("PORT") == 9100 and s.source("PORT") == "environment"
    assert s.model == model_308 and s.source("MODEL") == "command line"
    assert s.getint("DCP") == 4 and s.source("DCP").startswith("recipe")


def test_env_file_from_sparkctl_env_file_then_default(clean_env, tmp_path, model_308):
    named = tmp_path / "named.env"
    named.write_text(f'NODES="{NODES}"\nMODEL={model_308}\n')
    assert load(environ={"SPARKCTL_ENV_FILE": str(named)}).env_file == named
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "cluster.env").write_text(f'NODES="{NODES}"\nMODEL={model_308}\nPORT=7000\n')
    s = load()
    assert s.getint("PORT") == 7000 and "env/cluster.env" in s.source("PORT")


def test_missing_named_env_file_is_usage_error(clean_env, tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load(tmp_path / "nope.env")


def test_tp_not_divisible_by_dcp_names_values_and_sources(clean_env, tmp_path, model_308):
    env = tmp_path / "cluster.env"
    env.write_text(f'NODES="{NODES}"\nMODEL={model_308}\nDCP=3\n')
    with pytest.raises(UsageError) as exc:
        load(env)
    assert exc.value.message == (f"TP=4 must be divisible by DCP=3 (TP from recipe glm53-exl3-tp4, DCP from env file {env})")
    assert exc.value.fix and "sparkctl config" in exc.value.fix


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"TP": "four"}, "TP='four' (from environment) must be a whole number"),
        ({"GPU_MEMORY_UTILIZATION": "lots"}, "must be a number"),
        ({"MODEL": ""}, "MODEL is not set"),
        ({"MODEL": "relative/dir"}, "must be an absolute path"),
        ({"NODES": ""}, "NODES is not set"),
        ({"NODES": "a a b c"}, "listed twice"),
        ({"NODES": "a;b c d e"}, "not a valid SSH host alias"),
        ({"NODES": "a $(touch${IFS}x) c d"}, "not a valid SSH host alias"),
        ({"KV_CACHE_DTYPE": "fp9"}, "must be one of"),
        ({"PORT": "70000"}, "must be at most 65535"),
        ({"PORT": "29501"}, "PORT and MASTER_PORT must differ"),
        ({"SERVED_MODEL_NAME": "a\nb"}, "control characters"),
        ({"SPEC_METHOD": "dspark"}, "needs DSPARK"),
        ({"RANK7_CX7_IF": "eth0"}, "no rank 7"),
        ({"RANK1_FABRIC_IP": "10.0.0.300"}, "must be an IPv4 address"),
        ({"RANK1_CX7_IF": "a;b"}, "must be a device name"),
        ({"FABRIC_SUBNET": "10.0.0.0/99"}, "CIDR"),
        ({"TP": "8"}, "leftover nodes: spark1 spark2 spark3 spark4"),
        ({"RECIPE": "nope"}, "RECIPE='nope': no such recipe"),
    ],
)
def test_bad_values_are_usage_errors(clean_env, model_308, environ, expected):
    base = {"NODES": NODES, "MODEL": str(model_308)}
    with pytest.raises(UsageError) as exc:
        load(environ={**base, **environ})
    assert expected in str(exc.value)


def test_unknown_env_file_keys_are_reported_with_a_suggestion(clean_env, tmp_path, model_308):
    env = tmp_path / "cluster.env"
    env.write_text(f'NODES="{NODES}"\nMODEL={model_308}\nMAX_MODEL_LENGTH=5\n')
    s = load(env)
    assert s.warnings == [f"unknown key MAX_MODEL_LENGTH in env file {env} (did you mean MAX_MODEL_LEN?); it is ignored"]


def test_secrets_are_redacted_everywhere(clean_env, tmp_path, model_308):
    env = tmp_path / "cluster.env"
    env.write_text(f'NODES="{NODES}"\nMODEL={model_308}\nHF_TOKEN=hf_abc123\n')
    s = load(env, environ={"VLLM_API_KEY": "sk-zzz"})
    d = s.as_dict()
    assert d["HF_TOKEN"]["value"] == REDACTED and d["VLLM_API_KEY"]["value"] == REDACTED
    assert "hf_abc123" not in repr(d) and "sk-zzz" not in repr(d)
    assert s.describe("HF_TOKEN") == f"HF_TOKEN={REDACTED} (from env file {env})"
    assert s.secrets() == {"HF_TOKEN": "hf_abc123", "VLLM_API_KEY": "sk-zzz"}


def test_local_model_dir_stands_in_for_model(clean_env, model_308):
    s = load(environ={"NODES": NODES, "LOCAL_MODEL_DIR": str(model_308)})
    assert s.model == model_308 and "LOCAL_MODEL_DIR" in s.source("MODEL")


def test_rank_pins_from_knobs(clean_env, model_308):
    s = load(environ={"NODES": NODES, "MODEL": str(model_308), "RANK2_CX7_IF": "enP2p1s0f1np1",
                      "RANK2_GID_INDEX": "4", "RANK2_FABRIC_IP": "192.168.100.3", "RANK2_CX7_IB": "roceP2p1s0f1"})
    pins = s.rank_pins(2)
    assert (pins.netdev, pins.rdma_dev, pins.gid_index, pins.fabric_ip) == (
        "enP2p1s0f1np1", "roceP2p1s0f1", 4, "192.168.100.3")
    assert s.rank_pins(1).missing() == ["FABRIC_IP", "CX7_IF", "CX7_IB", "GID_INDEX"]


@pytest.mark.parametrize("recipe", ["glm53-exl3-tp4", "glm53-exl3-2.75bpw", "lab"])
def test_every_shipped_recipe_loads_and_validates(clean_env, model_308, recipe):
    s = load(environ={"NODES": NODES, "MODEL": str(model_308), "RECIPE": recipe})
    prebuilt = recipe == "glm53-exl3-2.75bpw"  # its card: the serve recipe's prebuilt image, no chain
    assert s.recipe.layer_names() == ([] if prebuilt else ["dcp", "mul1", "v145", "keys", "keys3"])
    assert (s.recipe.prebuilt is not None) == prebuilt
    assert s.recipe.memory.gpu_memory_utilization_cap == 0.82
    assert s.recipe.memory.overhead_gib == 14


def test_a_prebuilt_recipe_without_image_says_what_to_set(clean_env, model_308):
    s = load(environ={"NODES": NODES, "MODEL": str(model_308), "RECIPE": "glm53-exl3-2.75bpw"})
    with pytest.raises(UsageError, match="IMAGE is not set: recipe glm53-exl3-2.75bpw runs a prebuilt image") as e:
        _ = s.image
    assert "@sha256:" in (e.value.fix or "")
    ref = "registry.example/serve@sha256:" + "a" * 64
    assert load(environ={"NODES": NODES, "MODEL": str(model_308), "RECIPE": "glm53-exl3-2.75bpw",
                         "IMAGE": ref}).image == ref


def test_a_recipe_is_prebuilt_or_a_chain_not_both(clean_env, tmp_path, model_308):
    bad = tmp_path / "both.toml"
    text = (recipes_dir() / "glm53-exl3-tp4.toml").read_text()
    bad.write_text(text.replace("[checkpoint]", '[images.prebuilt]\nsource = "x"\n\n[checkpoint]'))
    with pytest.raises(UsageError, match="prebuilt image or builds a chain, not both"):
        load(environ={"NODES": NODES, "MODEL": str(model_308), "RECIPE": str(bad)})


def test_recipe_file_errors_name_the_key(clean_env, tmp_path, model_308):
    bad = tmp_path / "bad.toml"
    text = (recipes_dir() / "lab-vllm.toml").read_text()
    bad.write_text(text.replace("overhead_gib = 2", 'overhead_gib = "lots"'))
    with pytest.raises(UsageError, match=r"bad.toml/memory/overhead_gib: \"lots\", expected a number of at least 0"):
        load(environ={"NODES": NODES, "MODEL": str(model_308), "RECIPE": str(bad)})
