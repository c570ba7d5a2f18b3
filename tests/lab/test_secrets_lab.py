"""Secrets never leak, and the API key is enforced and sent, on real SSH and Docker.

A distinctive HF_TOKEN, VLLM_API_KEY and a STANDIN_*PASSWORD* live in an env file. Every command runs,
in human and --json form, and each output is grepped for them; so are every file sparkctl wrote here
(env.tp4) and on the nodes (~/.sparkctl: audit logs), every process's argv on this machine (the lab hosts
and their containers share its process table) and each container's Path/Args/Cmd. They travel only in
the per-rank env files: mode 0600, in 0700 folders, removed by `down`.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sparkctl.lab.state import HostPaths
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
CLUSTER_NAME = "secrets"
CLUSTER = {"CLUSTER_NAME": CLUSTER_NAME, "PORT": "18902", "MASTER_PORT": "39512"}
MARK = uuid.uuid4().hex
SECRETS = {"HF_TOKEN": f"hf_tok{MARK}", "VLLM_API_KEY": f"sk-key{MARK}", "STANDIN_DB_PASSWORD": f"pw{MARK}"}


def leaks(text: str) -> list[str]:
    """The secrets (or the distinctive part they share) that appear in text."""
    return [k for k, v in SECRETS.items() if v in text] + (["MARK"] if MARK in text else [])


@pytest.fixture
def secret_env(chain: Lab, tmp_path: Path) -> Iterator[tuple[Lab, Path, dict[str, str]]]:
    """An env file holding the lab's settings plus the secrets; the CLI runs in tmp_path (env/env.tp4 there)."""
    lab = chain
    env_file = tmp_path / "cluster.env"
    env_file.write_text(lab.env_file.read_text() + "".join(f"{k}={v}\n" for k, v in SECRETS.items()))
    env_file.chmod(0o600)
    env = {**lab.env(), "SPARKCTL_ENV_FILE": str(env_file), "NODES": " ".join(NODES), **CLUSTER, **pins(lab)}
    run(env, tmp_path, "down")
    try:
        yield lab, tmp_path, env
    finally:
        run(env, tmp_path, "lock", "--force-unlock")
        run(env, tmp_path, "down")


def pins(lab: Lab) -> dict[str, str]:
    return lab.pin_knobs(NODES)


def run(env: dict[str, str], cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def process_argvs() -> str:
    """Every process's argv on this machine (lab hosts and their containers included)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace"))
            except OSError:
                continue
    return "\n".join(out)


class ArgvSampler:
    """Reads every process's argv every few milliseconds while commands run, keeping each distinct one:
    the ssh, docker and sh processes a command starts live for milliseconds, and a secret on one of
    their command lines would be gone by the time a single look after the command ends."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.update(process_argvs().splitlines())
            self.samples += 1
            self._stop.wait(0.005)

    def __enter__(self) -> ArgvSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_secrets_appear_in_no_output_file_argv_or_audit(secret_env: tuple[Lab, Path, dict[str, str]]) -> None:
    lab, cwd, env = secret_env
    outputs: dict[str, subprocess.CompletedProcess[str]] = {}

    def step(*args: str, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        r = run(env, cwd, *args)
        outputs[" ".join(args)] = r
        assert r.returncode in ok, f"sparkctl {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    for json_flag in ((), ("--json",)):
        step(*json_flag, "config")
        step(*json_flag, "-v", "config")
        step(*json_flag, "plan")
        step(*json_flag, "check")  # discovers the pins and writes env/env.tp4 here
        step(*json_flag, "render", "--print-env")
    with ArgvSampler() as probe:  # the sampler itself: a 50 ms process with the mark on its argv is seen
        subprocess.run(["sh", "-c", "sleep 0.05", f"probe{MARK}"], check=True, timeout=10)
    assert leaks("\n".join(probe.seen)) == ["MARK"], "the sampler misses short-lived processes"
    with ArgvSampler() as sampler:  # every short-lived process `up` starts, here and on the hosts
        step("up")
    # the sampler saw `up` at work (its own python, the ssh to the nodes, the containers' engines)
    assert sampler.samples > 10 and any("sparkctl up" in a or "-m sparkctl up" in a for a in sampler.seen)
    assert any("vllm" in a and "serve" in a for a in sampler.seen), "no engine process was ever seen"
    assert leaks("\n".join(sampler.seen)) == [], "a secret was on a process's command line during `up`"
    step("--json", "up")  # nothing changed: the identical service
    step("wait", "--timeout", "60")
    step("--json", "wait", "--timeout", "60")
    step("status")
    step("--json", "status")
    step("logs", "--tail", "200")
    step("lock", "status")
    step("--json", "lock", "status")

    # While the service runs: argv of every process, and each container's command as Docker keeps it.
    assert leaks(process_argvs()) == [], "a secret is on a process's command line"
    for rank, node in enumerate(NODES):
        doc = json.loads(lab.docker(node, "inspect", f"sparkctl-{CLUSTER_NAME}-rank{rank}").stdout)[0]
        shown = json.dumps([doc["Path"], doc["Args"], doc["Config"]["Cmd"], doc["Config"].get("Entrypoint")])
        assert leaks(shown) == [], f"rank {rank}: a secret in the container's command"
        # They do reach the container, by its env file (vLLM reads VLLM_API_KEY from the environment).
        assert {f"{k}={v}" for k, v in SECRETS.items()} <= set(doc["Config"]["Env"])
        # The per-rank env file on the node: 0600, in 0700 folders.
        home = HostPaths.of(node, lab.root).home
        state = home / ".sparkctl" / CLUSTER_NAME
        rank_file = state / f"rank{rank}.env"
        assert stat.S_IMODE(rank_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((home / ".sparkctl").stat().st_mode) == 0o700

    step("audit")
    step("--json", "audit")
    step("down")
    step("--json", "down")
    # A validation error about another key, with the secrets loaded: the message names no secret.
    bad = run({**env, "TP": "3"}, cwd, "config")
    outputs["config (TP=3)"] = bad
    assert bad.returncode == 2 and "TP=3" in bad.stderr
    bad_json = run({**env, "MAX_MODEL_LEN": "lots"}, cwd, "--json", "up")
    outputs["up (bad MAX_MODEL_LEN)"] = bad_json
    assert bad_json.returncode == 2

    for name, r in outputs.items():
        assert "Traceback" not in r.stderr, f"{name}: {r.stderr}"
        assert leaks(r.stdout) == [] and leaks(r.stderr) == [], f"`sparkctl {name}` printed a secret"
        if name.startswith("--json"):
            json.loads(r.stdout)  # exactly one JSON document, even with secrets around

    # Every file sparkctl wrote here and on the nodes, after `down`: no secret anywhere.
    written = [p for p in cwd.rglob("*") if p.is_file() and p.name != "cluster.env"]
    assert any(p.name == "env.tp4" for p in written)
    for p in written:
        assert leaks(p.read_text(errors="replace")) == [], f"{p} holds a secret"
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, f"{p} is readable by others"
    for node in NODES:
        state = HostPaths.of(node, lab.root).home / ".sparkctl" / CLUSTER_NAME
        assert not list(state.glob("rank*.env")), f"{node}: `down` left a rank env file"
        for p in state.rglob("*"):
            if p.is_file():
                assert leaks(p.read_text(errors="replace")) == [], f"{node}:{p} holds a secret"
        assert (state / "audit.log").stat().st_size > 0


# ----------------------------------------------------------------------------------- the API key


def test_api_key_is_enforced_and_sent_by_wait_status_and_bench(secret_env: tuple[Lab, Path, dict[str, str]]) -> None:
    lab, cwd, env = secret_env
    up = run(env, cwd, "up")
    assert up.returncode == 0, up.stderr
    assert "without an API key" not in up.stderr  # the key is set: no warning
    wait = run(env, cwd, "wait", "--timeout", "60")
    assert wait.returncode == 0, wait.stderr
    base = f"http://{lab.host('spark1').mgmt_ip}:{CLUSTER['PORT']}"
    assert requests.get(f"{base}/v1/models", timeout=10).status_code == 401
    assert requests.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    ok = requests.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {SECRETS['VLLM_API_KEY']}"}, timeout=10)
    assert ok.status_code == 200
    status = run(env, cwd, "--json", "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["head"]["models"] == ["GLM-5.3-EXL3"]
    bench = run(env, cwd, "--json", "bench", "--workload", "prose", "--concurrency", "1", "--requests", "1",
                "--warmup", "0", "--max-tokens", "8", timeout=180)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert leaks(bench.stdout + bench.stderr) == []

    # The same commands with a wrong key: refused by the service, reported in one line, exit 1.
    wrong = {**env, "VLLM_API_KEY": "sk-wrong"}
    w = run(wrong, cwd, "wait", "--timeout", "20")
    assert w.returncode == 1 and "refused the API key" in w.stderr and "Traceback" not in w.stderr
    b = run(wrong, cwd, "bench", "--workload", "prose", "--concurrency", "1", "--requests", "1", "--warmup", "0",
            "--max-tokens", "8", timeout=60)
    assert b.returncode == 1 and "refused the API key" in b.stderr
    assert "sk-wrong" not in w.stdout + w.stderr + b.stdout + b.stderr


def test_up_warns_when_the_api_is_open_without_a_key(secret_env: tuple[Lab, Path, dict[str, str]]) -> None:
    lab, cwd, env = secret_env
    open_env = {**env, "VLLM_API_KEY": ""}
    up = run(open_env, cwd, "--json", "up")
    assert up.returncode == 0, up.stderr
    warning = [ln for ln in up.stderr.splitlines() if "without an API key" in ln]
    assert len(warning) == 1 and warning[0].startswith("warning:"), up.stderr
    json.loads(up.stdout)  # the warning is on stderr: stdout stays one JSON document
    assert run(open_env, cwd, "down").returncode == 0
    loopback = run({**open_env, "VLLM_EXTRA_ARGS": "--host 127.0.0.1"}, cwd, "up")
    assert loopback.returncode == 0 and "without an API key" not in loopback.stderr
