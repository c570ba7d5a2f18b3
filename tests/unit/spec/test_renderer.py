"""Golden tests: the exact env.tp4 and command lines for the default recipe (Kamal style).

Regenerate after an intended change with UPDATE_GOLDEN=1 and read the diff before committing.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import stat
from pathlib import Path

import pytest
from dotenv import dotenv_values

from sparkctl.errors import UsageError
from sparkctl.spec.builders import config_hash, docker_run_argv, rank_specs, vllm_serve_argv
from sparkctl.spec.planner import plan_for
from sparkctl.spec.renderer import _dotenv_quote, render_all, resolve_pins, write_private
from sparkctl.spec.settings import RankPins, load_settings

GOLDEN = Path(__file__).resolve().parent.parent.parent / "golden"
NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
MODEL = "/models/GLM-5.3-EXL3"
PINS = {
    # spark3's fabric address sits on the second CX7 port, with its own RDMA device and GID index.
    "RANK0_FABRIC_IP": "192.168.100.1", "RANK0_CX7_IF": "enp1s0f0np0", "RANK0_CX7_IB": "rocep1s0f0",
    "RANK0_GID_INDEX": "3",
    "RANK1_FABRIC_IP": "192.168.100.2", "RANK1_CX7_IF": "enp1s0f0np0", "RANK1_CX7_IB": "rocep1s0f0",
    "RANK1_GID_INDEX": "3",
    "RANK2_FABRIC_IP": "192.168.100.3", "RANK2_CX7_IF": "enP2p1s0f1np1", "RANK2_CX7_IB": "roceP2p1s0f1",
    "RANK2_GID_INDEX": "4",
    "RANK3_FABRIC_IP": "192.168.100.4", "RANK3_CX7_IF": "enp1s0f0np0", "RANK3_CX7_IB": "rocep1s0f0",
    "RANK3_GID_INDEX": "3",
}


@pytest.fixture
def settings(clean_env, tmp_path):
    from tests.conftest import write_model

    # The model lives at the production path in the golden output; plan from a sparse copy.
    write_model(tmp_path / "m", 308_000_000_000, 41)
    s = load_settings(cli={}, environ={"NODES": "spark1 spark2 spark3 spark4", "MODEL": MODEL, **PINS,
                                       "HF_TOKEN": "hf_secret_never_shown"})
    return s, tmp_path / "m"


def _plan(s, model_dir):
    from sparkctl.spec.planner import make_plan, read_checkpoint

    return make_plan(s, read_checkpoint(model_dir))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, f"{name} differs from the golden file (UPDATE_GOLDEN=1 to accept)"


def test_env_tp4_golden(settings):
    s, m = settings
    rendered = render_all(s, _plan(s, m), resolve_pins(s), now=NOW)
    check_golden("env.tp4", rendered.env_tp4)
    assert "hf_secret_never_shown" not in rendered.env_tp4


def test_docker_and_vllm_argv_golden(settings):
    s, m = settings
    rendered = render_all(s, _plan(s, m), resolve_pins(s), now=NOW)
    lines = [shlex.join(argv) for argv in rendered.docker_argv]
    check_golden("docker-run.txt", "\n".join(lines) + "\n")
    joined = "\n".join(lines)
    assert "hf_secret_never_shown" not in joined


def test_head_and_worker_serve_flags(settings):
    s, m = settings
    plan = _plan(s, m)
    pins = resolve_pins(s)
    head = vllm_serve_argv(s, plan, 0, pins)
    worker = vllm_serve_argv(s, plan, 2, pins)
    assert head[:3] == ["vllm", "serve", MODEL]
    assert "--headless" not in head and worker[-1] == "--headless"
    assert head[head.index("--master-addr") + 1] == "192.168.100.1" == worker[worker.index("--master-addr") + 1]
    assert worker[worker.index("--node-rank") + 1] == "2"
    assert head[head.index("--kv-cache-memory-bytes") + 1] == str(plan.kv_cache_memory_bytes)
    assert head[head.index("--speculative-config") + 1] == '{"method":"mtp","num_speculative_tokens":3}'
    # argparse prefix matching is on in vLLM: only full flag names, never abbreviations
    assert all(not a.startswith("-") or a.startswith("--") for a in head)


def test_rank_env_pins_and_secrets_only_in_env(settings):
    s, m = settings
    specs = rank_specs(s, _plan(s, m), resolve_pins(s))
    env = specs[2].env
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "enP2p1s0f1np1"
    # nothing in vLLM's NCCL tensor-parallel path reads these (docs/sources.md): not set
    assert "TP_SOCKET_IFNAME" not in env and "UCX_NET_DEVICES" not in env
    assert env["NCCL_IB_HCA"] == "roceP2p1s0f1" and env["NCCL_IB_GID_INDEX"] == "4"
    assert env["VLLM_HOST_IP"] == "192.168.100.3" and env["HF_TOKEN"] == "hf_secret_never_shown"
    assert env["NCCL_IB_DISABLE"] == "0" and env["HF_HUB_OFFLINE"] == "1"


def test_config_hash_changes_with_a_knob_and_a_rotated_secret(settings, tmp_path):
    s, m = settings
    plan = _plan(s, m)
    h1 = config_hash(s, rank_specs(s, plan, resolve_pins(s)))
    s2 = load_settings(cli={}, environ={"NODES": "spark1 spark2 spark3 spark4", "MODEL": MODEL, **PINS,
                                        "HF_TOKEN": "hf_rotated"})
    h2 = config_hash(s2, rank_specs(s2, plan, resolve_pins(s2)))
    s3 = load_settings(cli={}, environ={"NODES": "spark1 spark2 spark3 spark4", "MODEL": MODEL, **PINS,
                                        "HF_TOKEN": "hf_secret_never_shown", "PORT": "9999"})
    h3 = config_hash(s3, rank_specs(s3, plan, resolve_pins(s3)))
    assert len({h1, h2, h3}) == 3
    assert h1 == config_hash(s, rank_specs(s, plan, resolve_pins(s)))


def test_model_is_mounted_read_only(settings):
    s, m = settings
    rendered = render_all(s, _plan(s, m), resolve_pins(s), now=NOW)
    argv = rendered.docker_argv[0]
    assert argv[argv.index("--mount") + 1] == f"type=bind,source={MODEL},target={MODEL},readonly"


def test_missing_pins_name_the_key_and_node(clean_env, tmp_path):
    from tests.conftest import write_model

    m = write_model(tmp_path / "m", 1_000_000, 2)
    s = load_settings(cli={}, environ={"NODES": "spark1 spark2 spark3 spark4", "MODEL": str(m)})
    with pytest.raises(UsageError) as exc:
        render_all(s, plan_for(s), resolve_pins(s))
    assert "RANK0_FABRIC_IP (spark1)" in str(exc.value) and "sparkctl check" in str(exc.value)
    # check writes the pins into env/env.tp4, not into the user's env file: the fix says how to use them
    assert "--env-file env/env.tp4" in exc.value.fix


def test_discovered_pins_fill_in(clean_env, tmp_path):
    from tests.conftest import write_model

    m = write_model(tmp_path / "m", 1_000_000, 2)
    s = load_settings(cli={}, environ={"NODES": "a b c d", "MODEL": str(m), "RANK1_GID_INDEX": "7"})
    found = {r: RankPins(f"10.0.0.{r + 1}", "enp1s0f0np0", "rocep1s0f0", 3) for r in range(4)}
    pins = resolve_pins(s, found)
    assert pins[1].gid_index == 3 and pins[3].fabric_ip == "10.0.0.4"


def test_rendered_env_tp4_reads_back_as_an_env_file(settings, tmp_path):
    s, m = settings
    out = tmp_path / "env.tp4"
    write_private(out, render_all(s, _plan(s, m), resolve_pins(s), now=NOW).env_tp4)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    back = load_settings(env_file=str(out), cli={}, environ={})
    assert back.warnings == []
    assert back.rank_pins(2) == s.rank_pins(2)
    assert back.nodes == s.nodes and back.getint("KV_CACHE_MEMORY_BYTES") > 0


@pytest.mark.parametrize("value", ["plain", "with space", "quote'd", 'dq"x', "back\\slash", "$(touch /tmp/x)",
                                   "`id`", "a;b&&c", "ünï", "*glob?"])
def test_dotenv_quote_round_trips(tmp_path, value):
    f = tmp_path / "x.env"
    f.write_text(f"K={_dotenv_quote(value)}\n")
    assert dotenv_values(f, interpolate=False)["K"] == value


def test_docker_run_has_production_container_options(settings):
    s, m = settings
    plan = _plan(s, m)
    spec = rank_specs(s, plan, resolve_pins(s))[0]
    argv = docker_run_argv(s, spec, "abc")
    text = shlex.join(argv)
    for part in ["--network host", "--ipc host", "--ulimit nofile=1048576:1048576", "--ulimit memlock=-1:-1",
                 "--device /dev/infiniband", "--cap-add IPC_LOCK", "--gpus all", "--shm-size 64g",
                 "--label sparkctl.cluster=sparkctl", "--label sparkctl.rank=0", "--label sparkctl.config-hash=abc"]:
        assert part in text


@pytest.mark.parametrize("recipe", ["glm53-exl3-tp4", "glm53-exl3-2.75bpw"])
def test_every_production_docker_run_names_its_entrypoint(clean_env, tmp_path, recipe):
    """vLLM's OpenAI image (and Mia's base on it) has ENTRYPOINT ["vllm", "serve"]: `IMAGE vllm serve`
    would run `vllm serve vllm serve`. Every rank's command is `--entrypoint vllm IMAGE serve MODEL`."""
    from tests.conftest import write_model

    write_model(tmp_path / "m", 258_000_000_000, 81)
    image = {"IMAGE": "registry.example/serve@sha256:" + "b" * 64} if recipe == "glm53-exl3-2.75bpw" else {}
    s = load_settings(cli={"RECIPE": recipe},
                      environ={"NODES": "spark1 spark2 spark3 spark4", "MODEL": MODEL, **PINS, **image})
    assert s.recipe.name == recipe
    rendered = render_all(s, _plan(s, tmp_path / "m"), resolve_pins(s), now=NOW)
    for argv in rendered.docker_argv:
        image = argv.index(str(s.get("IMAGE")))
        assert argv[image - 2: image] == ["--entrypoint", "vllm"]
        assert argv[image + 1: image + 3] == ["serve", MODEL]
        assert "vllm" not in argv[image + 1:]
        assert argv[argv.index("--quantization") + 1] == "exl3"
