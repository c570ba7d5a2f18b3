"""The argv judge (sparkctl/probes/argv_judge.py) run by the real vLLM for CPU, 0.32.

`check` and `up` run the script inside the serving image on the head; here it runs in the real-engine venv
directly (the venv the lab's sparkctl-lab/vllm:0.32.0-cpu image is made of), on lab-vllm's argv as
sparkctl renders it, over the tiny Llama of make_model.py: the good argv passes; an unknown flag, a bad
value, an architecture vLLM does not know and a head size the CPU attention refuses are each refused in
vLLM's own words. One judge process answers every case (it imports torch and vLLM once).

0.32 against 0.33 (the fidelity venv's, the referee of what sparkctl renders): of the flags sparkctl and
the recipes render, the two parsers differ on one, `--kv-cache-dtype` (0.32 checks its choices at
parse time, 0.33 takes any string there); every KV_CACHE_DTYPE sparkctl accepts is one of 0.32's
choices, so no recipe is refused for it, and a value 0.33 parses but 0.32 does not know is refused by
0.32's own parser.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sparkctl.remote.argv_verdict import SCRIPT, parse_output
from sparkctl.spec.resources import probe_script
from tests.realengine.test_conformance import model, real_venv  # noqa: F401 - fixtures

pytestmark = pytest.mark.realengine

NODES = "a b"
PINS = {f"RANK{r}_{k}": v for r in (0, 1) for k, v in
        (("FABRIC_IP", f"10.9.0.{r + 1}"), ("CX7_IF", "eth1"), ("CX7_IB", "mlx5_0"), ("GID_INDEX", "3"))}
FIDELITY_VENV = Path(os.environ.get("SPARKCTL_FIDELITY_VENV", "/var/cache/sparkctl/fidelity-venv"))


def lab_vllm_argv(model_dir: Path, extra: str = "") -> list[list[str]]:
    """Every rank's `vllm serve` argv for recipe lab-vllm, as `up` renders it (settings → plan → builders)."""
    from sparkctl.spec import planner as planmod
    from sparkctl.spec.builders import vllm_serve_argv
    from sparkctl.spec.renderer import resolve_pins
    from sparkctl.spec.settings import load_settings

    env = {"NODES": NODES, "MODEL": str(model_dir), "RECIPE": "lab-vllm", **PINS,
           **({"VLLM_EXTRA_ARGS": extra} if extra else {})}
    settings = load_settings(cli={}, environ=env)
    plan = planmod.make_plan(settings, planmod.read_checkpoint(settings.model, None), compute_capability="12.1")
    pins = resolve_pins(settings)
    return [vllm_serve_argv(settings, plan, r, pins) for r in range(len(settings.nodes))]


def judge(python: Path, argvs: list[list[str]], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    ranks = [{"rank": i, "argv": a} for i, a in enumerate(argvs)]
    r = subprocess.run([str(python), "-", json.dumps(ranks)], input=probe_script(SCRIPT), capture_output=True,
                       timeout=600, env={**os.environ, **(env or {})})
    found = parse_output(r.stdout.decode("utf-8", "replace"))
    assert sorted(found) == list(range(len(argvs))), r.stderr.decode()[-3000:]
    return [found[i] for i in range(len(argvs))]


def variant(model_dir: Path, dest: Path, **config: Any) -> Path:
    """The model with its config.json changed (the weights are symlinks: nothing reads them here)."""
    dest.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f)
    doc = json.loads((model_dir / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**doc, **config}))
    return dest


@pytest.fixture(scope="module")
def verdicts(real_venv: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # noqa: F811
    work = tmp_path_factory.mktemp("argv-judge")
    arch = variant(model, work / "arch", architectures=["NoSuchModelForCausalLM"])
    head16 = variant(model, work / "head16", head_dim=16)
    good = lab_vllm_argv(model)
    cases = {
        "head": good[0], "worker": good[1],
        "unknown-flag": good[0] + ["--no-such-flag"],
        "bad-value": [*good[0][:-1], "four"] if good[0][-2] == "--max-num-seqs" else good[0] + ["--max-num-seqs", "four"],
        "architecture": lab_vllm_argv(arch)[0],
        "head-size": lab_vllm_argv(head16)[0],
    }
    out = judge(real_venv / "bin" / "python", list(cases.values()))
    return dict(zip(cases, out, strict=True))


def test_the_argv_sparkctl_renders_is_accepted_by_vllm_032(verdicts: dict[str, Any]) -> None:
    for case in ("head", "worker"):
        v = verdicts[case]
        assert (v["verdict"], v["stage"], v["vllm"]) == ("ok", "attention", "0.32.0"), v


def test_an_unknown_flag_is_refused_in_argparses_words(verdicts: dict[str, Any]) -> None:
    v = verdicts["unknown-flag"]
    assert (v["verdict"], v["stage"]) == ("refused", "parse")
    assert v["words"] == "vllm: error: unrecognized arguments: --no-such-flag"


def test_a_bad_value_is_refused_in_argparses_words(verdicts: dict[str, Any]) -> None:
    v = verdicts["bad-value"]
    assert (v["verdict"], v["stage"]) == ("refused", "parse")
    assert v["words"] == "vllm serve: error: argument --max-num-seqs: invalid int value: 'four'"


def test_an_architecture_vllm_does_not_know_is_refused_by_its_model_config(verdicts: dict[str, Any]) -> None:
    v = verdicts["architecture"]
    assert (v["verdict"], v["stage"]) == ("refused", "config")
    assert "Model architectures ['NoSuchModelForCausalLM'] are not supported for now" in v["words"]


def test_a_head_size_the_cpu_attention_refuses_is_refused_with_its_table(verdicts: dict[str, Any]) -> None:
    v = verdicts["head-size"]
    assert (v["verdict"], v["stage"]) == ("refused", "attention")
    assert "head_size not supported" in v["words"] and "this model's is 16" in v["words"]
    assert "[32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]" in v["words"]  # vLLM 0.32's own table


# ---- 0.32 against 0.33 ------------------------------------------------------------------------------

OPTIONS = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand
root = FlexibleArgumentParser(description="vLLM CLI")
serve = ServeSubcommand().subparser_init(root.add_subparsers(required=False, dest="subparser"))
print("@@options " + json.dumps({o: {"dest": a.dest, "nargs": str(a.nargs),
                                    "choices": sorted(map(str, a.choices)) if a.choices else None}
                                for o, a in serve._option_string_actions.items()}))
"""


@pytest.fixture(scope="module")
def fidelity_python() -> Path:
    python = FIDELITY_VENV / "bin" / "python"
    if not python.exists():
        if os.environ.get("SPARKCTL_REALENGINE") == "1":
            pytest.fail(f"no fidelity venv at {FIDELITY_VENV} (tests/fidelity/setup_venv.sh builds it)")
        pytest.skip(f"no fidelity venv at {FIDELITY_VENV}")
    return python


def options(python: Path) -> dict[str, Any]:
    r = subprocess.run([str(python), "-c", OPTIONS], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("@@options ")), None)
    assert line, r.stderr[-2000:]
    return dict(json.loads(line[len("@@options "):]))


def rendered_flags(model_dir: Path) -> set[str]:
    """Every flag sparkctl renders for any recipe: builders' own and every recipe's extra_args."""
    from sparkctl.spec.recipes import available_recipes, load_recipe

    flags = {w for argv in lab_vllm_argv(model_dir) for w in argv if w.startswith("--")}
    flags |= {"--speculative-config"}  # rendered for MTP/DSpark recipes; lab-vllm has none
    for name in available_recipes():
        flags |= {w for w in load_recipe(name).vllm_extra_args if w.startswith("--")}
    return flags


def test_vllm_032_and_033_differ_on_one_rendered_flag_and_032_refuses_what_only_033_parses(
        real_venv: Path, fidelity_python: Path, model: Path) -> None:  # noqa: F811
    from sparkctl.spec.settings import KV_CACHE_DTYPES

    old, new = options(real_venv / "bin" / "python"), options(fidelity_python)
    flags = rendered_flags(model)
    assert flags <= set(old) and flags <= set(new), (flags - set(old), flags - set(new))
    differ = sorted(f for f in flags if old[f] != new[f])
    assert differ == ["--kv-cache-dtype"], differ
    assert old["--kv-cache-dtype"]["choices"] and new["--kv-cache-dtype"]["choices"] is None
    assert set(KV_CACHE_DTYPES) <= set(old["--kv-cache-dtype"]["choices"]), "a KV_CACHE_DTYPE 0.32 refuses"

    argv = lab_vllm_argv(model)[0]
    at = argv.index("--kv-cache-dtype") + 1
    moved = [*argv[:at], "octave_k3v4", *argv[at + 1:]]  # in 0.33's CacheDType, not in 0.32's
    (v032,) = judge(real_venv / "bin" / "python", [moved])
    assert (v032["verdict"], v032["stage"]) == ("refused", "parse"), v032
    assert "argument --kv-cache-dtype: invalid choice: 'octave_k3v4'" in v032["words"]
    (v033,) = judge(fidelity_python, [moved], env={"VLLM_TARGET_DEVICE": "cpu"})
    assert v033["vllm"] == "0.33.0" and v033["stage"] != "parse", v033  # 0.33's parser takes it
