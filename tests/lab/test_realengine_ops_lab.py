"""The operator's commands on the real engine: SIGTERM during `up`, `render --target lws` against
the argv that ran, `bench` with real tokens against vLLM's own `vllm bench serve` on the same engine at the
same time, and `rollback` to the previous config. Recipe lab-vllm, TP 2 over spark1 and spark3 (the kit in
tests/lab/realengine.py). Every wait is bounded; no assertion is about time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkctl.loadgen import inputs, level
from sparkctl.measure import vllm_bench as vllmbench
from sparkctl.orchestrate import bench as flow
from sparkctl.remote import headapi
from tests.kit.lab import Lab
from tests.lab.realengine import PAIR, START_S, chat, fresh, head_url, must, rank_containers, sk

pytestmark = pytest.mark.realengine_lab

NONE = {n: "" for n in PAIR}
# metric: (relative, absolute), |sparkctl − vLLM| ≤ max(rel × vLLM, abs), on the medians: one request of twelve
# that met the other tool's first prefill moved a mean by 3-5× here (sparkctl's mean TTFT 222 ms against 108;
# then vLLM's 314 against 65, its median 86), and sparkctl measures from this machine over the lab's network
# while vLLM's client runs in the head's container. Bounds that catch a wrong definition (seconds for ms,
# chunks counted as tokens, the wall to [DONE]); the tight agreement is the loopback test's
# (tests/realengine/test_bench_agreement.py) and the exact one the fidelity suite's.
LAB_TOLERANCE = {"median_ttft_ms": (0.50, 30.0), "median_tpot_ms": (0.50, 1.5), "output_throughput": (0.35, 0.0)}


def _argv(lab: Lab, node: str, cid: str) -> list[str]:
    """What the container runs: its entrypoint and command, as Docker recorded them."""
    doc = json.loads(lab.docker(node, "inspect", cid, check=True).stdout)[0]
    return [*(doc["Config"].get("Entrypoint") or []), *(doc["Config"].get("Cmd") or [])]


def _lock_free(env: dict[str, str]) -> bool:
    return json.loads(sk(env, "--json", "lock", "status", timeout=30).stdout)["locked"] is False


def test_sigterm_during_up_on_the_real_engine_leaves_nothing(real: dict[str, str], lab: Lab) -> None:
    """SIGTERM once `up` has started a real rank: exit 143, every rank container removed, the lock free."""
    env = real
    fresh(env)
    proc = subprocess.Popen([sys.executable, "-m", "sparkctl", "up"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    started = False
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(rank_containers(lab).values()):
            started = True
            break
        time.sleep(0.05)
    assert started, "up never started a rank container"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, out + err
    assert "rolling back" in out + err, out + err
    assert rank_containers(lab) == NONE
    # nothing of this cluster's at all (the argv judge's container included)
    assert [lab.docker(n, "ps", "-aq", "--filter", "label=sparkctl.cluster=vllmlab").stdout.split() for n in PAIR] == [[], []]
    assert _lock_free(env)


def _vllm_bench_beside_sparkctl(lab: Lab, env: dict[str, str], head_cid: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's `vllm bench serve` in the head's container (as `bench --tool vllm` runs it) and sparkctl's load
    generator from this machine, on the same engine at the same time (tests/realengine/test_bench_agreement.py
    says why at the same time, and why at raised priority); both results."""
    n, input_len, output_len = 12, 32, 64
    argv = vllmbench.bench_serve_argv(base_url=f"http://127.0.0.1:{env['PORT']}", model="lab-llama",
                                      tokenizer="/models/lab-vllm", input_len=input_len, output_len=output_len,
                                      num_prompts=n, max_concurrency=1)
    nice = ["nice", "-n", "-10"] if os.geteuid() == 0 else []
    ref = subprocess.Popen([*nice, "docker", "-H", lab.host(PAIR[0]).docker_host, *vllmbench.exec_argv(head_cid, argv)[1:]],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert ref.stdin is not None and ref.stdout is not None
    ref.stdin.write("\n")  # no API key
    ref.stdin.close()
    killer = threading.Timer(600, ref.kill)  # bounds every read below
    killer.start()
    try:
        log = []
        for line in ref.stdout:
            log.append(line)
            if "Starting main benchmark run" in line:
                break
        assert any("Starting main benchmark run" in x for x in log), "".join(log[-40:])
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
        try:
            cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse(head_url(lab, "")), model="lab-llama",
                                      concurrency=[1], requests=n, warmup=1, max_tokens=output_len,
                                      input_len=input_len, timeout=120, workloads=[inputs.builtin_workload("prose")])
            run = flow.run_bench(cfg)
        finally:
            if nice:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        rest = ref.stdout.read()
        assert ref.wait(timeout=60) == 0, "".join(log) + rest
    finally:
        killer.cancel()
    mine = run.to_dict()["workloads"]["prose"][0]
    theirs = vllmbench.parse_result(rest, f"{PAIR[0]} ({head_cid})")
    assert mine["completed"] == theirs["completed"] == n
    assert mine["total_output_tokens"] == theirs["total_output_tokens"] == n * output_len
    return mine, theirs


def test_render_bench_and_rollback_on_one_real_service(real: dict[str, str], lab: Lab, tmp_path: Path) -> None:
    """One service, three claims: `render --target lws` gives the argv that ran; `bench` agrees with vLLM's own
    benchmark on real tokens; `rollback` brings the previous config back through `up`."""
    env = real
    fresh(env)
    must(sk(env, "up", timeout=300), "up")
    must(sk(env, "wait", "--timeout", str(START_S), timeout=START_S + 60), "wait")
    ids = rank_containers(lab)
    ran = {n: _argv(lab, n, ids[n]) for n in PAIR}

    # render --target lws: one pod template, so it needs nodes whose fabric NICs have the same names and GID
    # index; spark3's is on its second port (refused, naming it), so the manifest is rendered for spark1 +
    # spark4 (the same names and GID index as spark1), the same head
    refused = sk(env, "render", "--target", "lws", "--out", str(tmp_path / "no.yaml"), extra=lab.pin_knobs(PAIR))
    assert refused.returncode == 2 and "RANK1_CX7_IF=enp1s0f1np1 (spark3)" in refused.stderr, refused.stderr
    pair14 = ["spark1", "spark4"]
    out = tmp_path / "lws.yaml"
    must(sk(env, "render", "--target", "lws", "--out", str(out), extra={"NODES": " ".join(pair14),
                                                                        **lab.pin_knobs(pair14)}), "render")
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d and d.get("kind") == "LeaderWorkerSet"]
    tpl = docs[0]["spec"]["leaderWorkerTemplate"]
    subst = {"$(LWS_LEADER_ADDRESS)": lab.host(PAIR[0]).fabric_ip}
    for node, key, rank in ((PAIR[0], "leaderTemplate", "0"), (PAIR[1], "workerTemplate", "1")):
        c = tpl[key]["spec"]["containers"][0]
        lws_argv = [subst.get(a, a) for a in [*c["command"], *c["args"]]]
        lws_argv = [rank if a == "$(LWS_WORKER_INDEX)" else a for a in lws_argv]
        assert lws_argv == ran[node], (node, lws_argv, ran[node])

    # rollback: a second config (a shorter context: another --max-model-len and KV bytes), then the first again
    two = {"MAX_MODEL_LEN": "512"}
    must(sk(env, "up", extra=two, timeout=300), "up (MAX_MODEL_LEN=512)")
    must(sk(env, "wait", "--timeout", str(START_S), extra=two, timeout=START_S + 60), "wait")
    head = rank_containers(lab)[PAIR[0]]
    argv2 = _argv(lab, PAIR[0], head)
    assert argv2[argv2.index("--max-model-len") + 1] == "512", argv2
    must(sk(env, "rollback", extra=two, timeout=300), "rollback")
    must(sk(env, "wait", "--timeout", str(START_S), timeout=START_S + 60), "wait after rollback")
    back = rank_containers(lab)
    assert back[PAIR[0]] != head
    assert {n: _argv(lab, n, back[n]) for n in PAIR} == ran
    assert chat(lab)[0] == 200
    # bench with real tokens, beside vLLM's own benchmark
    mine, theirs = _vllm_bench_beside_sparkctl(lab, env, back[PAIR[0]])
    lines, misses = [], []
    for key, (rel, floor) in LAB_TOLERANCE.items():
        a, b = mine[key], theirs[key]
        lines.append(f"{key:<24}{a:>12.2f}{b:>12.2f}{(a - b) / b * 100:>+9.1f}%")
        if abs(a - b) > max(rel * b, floor):
            misses.append(key)
    print("\n".join(lines))
    assert not misses, "\n".join(lines)

    must(sk(env, "down", timeout=120), "down")
    assert rank_containers(lab) == NONE


def test_a_second_family_from_its_config_alone_serves_on_the_real_engine(real: dict[str, str], lab: Lab,
                                                                          tmp_path: Path) -> None:
    """A Qwen3 (per-head q/k norms: not the tiny Llama's family), random weights made offline, never seen by
    any recipe: `recipe new --like lab-vllm` plans it from its config.json on the lab's platform; `check` (the
    argv judge: the image's own vLLM parses the argv) passes, `up` and `wait` bring the real vLLM up on it,
    it answers a chat completion under its planned name, `down` leaves nothing."""
    from sparkctl.lab.vllm_image import venv_dir

    made = tmp_path / "qwen3-tiny"
    r = subprocess.run([str(venv_dir() / "bin" / "python"), str(Path(__file__).parents[1] / "realengine" / "make_model.py"),
                        str(made), "--family", "qwen3"], capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
                            "TRANSFORMERS_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    recipe = tmp_path / "qwen3.toml"
    must(sk(real, "recipe", "new", "--model", str(made), "--nodes", "2", "--like", "lab-vllm", "--name", "lab-qwen3",
            "--out", str(recipe)), "recipe new")
    for n in PAIR:
        shutil.copytree(made, lab.host(n).model_dir / "qwen3-tiny", dirs_exist_ok=True)
    env = {**real, "RECIPE": str(recipe), "MODEL": f"{lab.model_path}/qwen3-tiny"}
    for key in ("IMAGE", "BASE_IMAGE"):
        env.pop(key, None)  # the recipe's (the lab's real base, run prebuilt)
    try:
        fresh(env)
        must(sk(env, "check", timeout=600), "check")
        must(sk(env, "up", timeout=300), "up")
        must(sk(env, "wait", "--timeout", str(START_S), timeout=START_S + 60), "wait")
        status, answer = chat(lab, timeout=120, model="lab-qwen3")
        assert status == 200 and answer["model"] == "lab-qwen3", answer
        assert answer["choices"][0]["message"]["content"] is not None, answer
        ids = rank_containers(lab)
        ran = json.loads(lab.docker(PAIR[0], "inspect", ids[PAIR[0]], check=True).stdout)[0]["Config"]
        assert f"{lab.model_path}/qwen3-tiny" in [*(ran.get("Entrypoint") or []), *(ran.get("Cmd") or [])]
        must(sk(env, "down", timeout=120), "down")
        assert rank_containers(lab) == NONE
    finally:
        sk(env, "down", timeout=120)
        for n in PAIR:
            shutil.rmtree(lab.host(n).model_dir / "qwen3-tiny", ignore_errors=True)


def test_deploy_yes_serves_the_real_engine_then_a_rerun_is_a_noop(real: dict[str, str], lab: Lab) -> None:
    """`deploy --yes` from nothing running to the real vLLM serving (recipe lab-vllm: the checkpoint already on
    both ranks, its chain built): up and wait done, a real completion and the short bench in the report, the
    API answering; a second `deploy --yes` changes nothing. Last in the module: its setup step may re-address
    the lab's fabric, which the tests above pin."""
    env = real
    fresh(env)
    r = sk(env, "deploy", "--yes", "--json", "--timeout", str(START_S), timeout=START_S + 900)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    st = {s["step"]: s["status"] for s in d["steps"]}
    assert (st["pull"], st["sync"], st["up"], st["wait"]) == ("skipped", "skipped", "done", "done"), st
    assert d["api"]["model"] == "lab-llama" and d["api"]["completion"] and d["api"]["bench"], d["api"]
    assert chat(lab)[0] == 200
    ids = rank_containers(lab)
    assert all(ids.values())
    r = sk(env, "deploy", "--yes", "--json", "--no-bench", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    again = json.loads(r.stdout)
    assert again["noop"] and not again["changed"], again
    assert rank_containers(lab) == ids  # nothing replaced
    must(sk(env, "down", timeout=120), "down")
    assert rank_containers(lab) == NONE
