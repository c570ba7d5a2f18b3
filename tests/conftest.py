"""Shared fixtures. Unit tests never touch the network; lab tests live in tests/lab/."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

# A suite started in the background by a shell without job control (`cmd &` in a script, `setsid … &`, nohup)
# inherits SIGINT ignored, and Python then keeps it ignored: `_thread.interrupt_main()`, the tests' Ctrl-C, does
# nothing, and every Ctrl-C test fails with "DID NOT RAISE KeyboardInterrupt" (seen: four of them, in a CI run
# started so). The tests need Python's own handler, as an interactive `sparkctl` has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the fidelity venv (vLLM's own code only) has no Hypothesis, and needs none
    settings = None  # type: ignore[assignment]

# One Hypothesis profile for the whole suite: derandomized and without an example database, so every
# run -- CI or a laptop -- tries exactly the same examples and the counts the README quotes are exact.
# Tests set max_examples themselves (the lab's are expensive). SPARKCTL_HYPOTHESIS=explore turns on
# random examples (and 5x as many) for a local hunt; a failure there prints the example to pin down.
if settings is not None:
    settings.register_profile(
        "sparkctl", derandomize=True, database=None, deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    settings.register_profile("explore", parent=settings.get_profile("sparkctl"), derandomize=False,
                              max_examples=500)
    settings.load_profile(os.environ.get("SPARKCTL_HYPOTHESIS", "sparkctl"))

# This machine's caches (the checkpoint summaries and deep hashes under ~/.cache/sparkctl) are the
# user's: the suite's hundreds of throwaway checkpoints go to a cache of its own, removed with it.
# The suite chooses its clusters itself: a user's exported `lab up` lines (SPARKCTL_ENV_FILE, SPARKCTL_SSH_CONFIG,
# which `lab up` prints for export) must not point the unit tests at the lab's env file (six tests then read
# lab-vllm.env instead of their own settings). Lab tests pass the lab's files explicitly (Lab.env()).
for _var in ("SPARKCTL_ENV_FILE", "SPARKCTL_SSH_CONFIG"):
    os.environ.pop(_var, None)

if "SPARKCTL_TEST_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="sparkctl-test-cache-")
    os.environ["SPARKCTL_TEST_CACHE"] = os.environ["XDG_CACHE_HOME"] = _cache
    atexit.register(shutil.rmtree, _cache, True)

@pytest.fixture(autouse=True)
def _lock_root_of_each_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared cluster lock (sparkctl.remote.lockdir.LOCK_ROOT, /var/tmp on a node) in a folder of each test
    node's own: relative, so it is made in the working directory of the command (a test node's home),
    never in this machine's /var/tmp, where tests running side by side would meet."""
    try:
        from sparkctl.remote import lockdir as _lock
    except ImportError:  # the fidelity venv without sparkctl's dependencies
        return
    monkeypatch.setattr(_lock, "LOCK_ROOT", "var-tmp")


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> object:
    """Each test starts with the signal handlers and sparkctl.signals' state it found, whatever the
    previous test ran in-process: a CLI run installs sparkctl's handler, and one that reached its point
    of no return left it noting Ctrl-C instead of raising it, so a later test's `interrupt_main()` did
    nothing (test_threads after test_json_failures, seen in a random-order run)."""
    import signal as _signal

    handled = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
    before = {sig: _signal.getsignal(sig) for sig in handled}
    try:
        from sparkctl import signals as _sk_signals
    except ImportError:  # the fidelity venv without sparkctl's dependencies
        _sk_signals = None  # type: ignore[assignment]
    if _sk_signals is not None:
        _sk_signals.reset()
    yield
    for sig, handler in before.items():
        if handler is not None:
            _signal.signal(sig, handler)
    if _sk_signals is not None:
        _sk_signals.reset()


GLM53_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 78,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 256,
    "first_k_dense_replace": 3,
    "hidden_size": 6144,
    "moe_intermediate_size": 2048,
}


def write_model(dest: Path, total_bytes: int, shards: int, config: dict | None = None) -> Path:
    """config.json + an index + sparse shards adding up to total_bytes (no headers: planner/render only)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config or GLM53_CONFIG))
    weight_map = {}
    per = total_bytes // shards
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        weight_map[f"tensor.{i}"] = name
        size = per if i < shards - 1 else total_bytes - per * (shards - 1)
        with open(dest / name, "wb") as fh:
            fh.truncate(size)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


@pytest.fixture
def model_308(tmp_path: Path) -> Path:
    return write_model(tmp_path / "GLM-5.3-EXL3", 308_000_000_000, 41)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """An empty process environment and a cwd without env/cluster.env."""
    monkeypatch.chdir(tmp_path)
    return {}


def write_serving(model: Path) -> None:
    """The checkpoint's serving/ folder as the lab's generated checkpoint ships it (the chain's
    Dockerfiles and what they copy): `build` reads the chain from there."""
    from sparkctl.lab.ckptgen import serving_files

    for name, data in serving_files().items():
        (model / "serving" / name).parent.mkdir(parents=True, exist_ok=True)
        (model / "serving" / name).write_bytes(data)


def prebuilt_recipe(dest: Path, name: str = "lab-prebuilt") -> Path:
    """The lab recipe with its chain replaced by [images.prebuilt] (everything else as the lab runs it):
    a recipe that runs a published image, as the 2.75 bpw recipe does."""
    from sparkctl.spec.recipes import recipes_dir

    text = (recipes_dir() / "lab.toml").read_text()
    start, end = text.index("\n[images]"), text.index("\n[checkpoint]")
    body = text[:start] + '\n[images.prebuilt]\nsource = "the lab\'s test image"\n' + text[end:]
    body = body.replace('name = "lab"', f'name = "{name}"', 1)
    body = "\n".join(ln for ln in body.splitlines() if not ln.startswith(("IMAGE =", "BASE_IMAGE ="))) + "\n"
    assert "[[images.layers]]" not in body and f'name = "{name}"' in body
    path = dest / f"{name}.toml"
    path.write_text(body)
    return path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """sparkctl's CLI in this process, as a user runs it: (exit status, stdout, stderr).

    main() installs sparkctl's signal handlers and ends committed (a SIGINT noted, never raised): both
    are undone after, so a later test's Ctrl-C (`_thread.interrupt_main`) is a KeyboardInterrupt again."""
    import signal

    from sparkctl import signals
    from sparkctl.cli import main

    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    try:
        with pytest.raises(SystemExit) as exc:
            main(argv)
    finally:
        signals.reset()
        for s, handler in saved.items():
            signal.signal(s, handler)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err
