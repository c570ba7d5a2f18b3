"""The rules of `sparkctl check` (facts in, findings out) and the command's table, JSON and exit codes.

Facts are built from real captured output where the parsers are involved (tests/fixtures/), and as
plain dataclasses where a rule only needs one value. Every failing finding must carry a one-line fix.
Fabric discovery (nic_pins.discover_fabric) is mostly covered in test_nic_pins.py; this file adds the rest.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import shutil
import socketserver
import subprocess
import threading
import urllib.parse
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sparkctl.checkpoint.verify import Report, Summary, issue
from sparkctl.cluster import NodeError
from sparkctl.facts import node_facts as F
from sparkctl.orchestrate.check import CheckReport
from sparkctl.probes.ckpt_scan import _encode
from sparkctl.rules import check_rules as C
from sparkctl.rules.check_rules import FAIL, OK, SKIP, WARN, Finding, Needs, _names_device, rule_pin_env
from sparkctl.rules.nic_pins import discover_fabric
from sparkctl.spec.planner import GB, CheckpointInfo, Plan, Shard, make_plan
from sparkctl.spec.settings import RankPins, Settings, load_settings
from tests.conftest import GLM53_CONFIG

FIX = Path(__file__).resolve().parent.parent.parent / "fixtures"
PROBE = Path(C.__file__).resolve().parent.parent / "probes" / "node_facts.sh"
REACH = PROBE.with_name("reach.sh")
NODES = ["spark1", "spark2", "spark3", "spark4"]
SHARDS = {f"model-0000{i}-of-00003.safetensors": 1_000_000 * i for i in (1, 2, 3)}


def fixture(path: str) -> str:
    return (FIX / path).read_text()


def needs(**overrides: Any) -> Needs:
    base: dict[str, Any] = dict(
        nofile=1048576, memlock_bytes=-1, gpus_per_node=1, port=8888, master_port=29501,
        fabric_subnet=ipaddress.IPv4Network("10.232.0.0/24"), image="sparkctl-lab/engine:latest",
        cluster="sparkctl", model="/models/lab", given_pins=(RankPins(),) * 4,
    )  # fmt: skip
    base.update(overrides)
    return Needs(**base)


def healthy() -> F.NodeFacts:
    """A node as the probe sees a good one: captured docker/meminfo/ss/df output, a GB10 nvidia-smi."""
    return F.NodeFacts(
        hostname="spark1",
        arch="aarch64",
        meminfo=F.parse_meminfo(fixture("host/proc-meminfo.txt")),
        nofile_hard=1048576,
        memlock_hard_kib=F.UNLIMITED,
        gpus=F.parse_nvidia_smi_query("NVIDIA GB10, 580.95.05, [N/A], 12.1, 1\n"),
        gpu_banner=F.parse_nvidia_smi_banner(fixture("nvidia-smi-gb10/plain.txt")),
        listeners=F.parse_listening_ports("LISTEN 0 128 0.0.0.0:22 0.0.0.0:*\n"),
        disks=[F.DiskUsage("/dev/nvme0n1p2", 4000 * GB, 1000 * GB, 3000 * GB, "/")],
        docker=F.parse_docker_version(fixture("docker/version.json")),
        containers=[],
        images=[],
        model=F.ModelListing(True, {**SHARDS, "config.json": 900}),
    )


def fails_with_fix(f: Finding, *words: str) -> None:
    """A failure: it says what and where, and carries a one-line fix."""
    assert f.status == FAIL, f
    assert f.fix and "\n" not in f.fix, f"no one-line fix: {f}"
    for w in words:
        assert w in f.text, f"{w!r} not in {f.text!r}"


# -------------------------------------------------------------------------------------------- ssh


@pytest.mark.parametrize(
    ("kind", "short"),
    [("hostkey-changed", "HOST KEY CHANGED"), ("hostkey-unknown", "unknown host key"), ("refused", "refused"),
     ("timeout", "timeout"), ("auth", "auth failed"), ("dns", "no such host"), ("lost", "lost")],
)  # fmt: skip
def test_ssh_failure_kinds(kind: str, short: str) -> None:
    f = C.rule_ssh("spark2", NodeError("spark2", kind, "it broke", "do the thing"))
    fails_with_fix(f, "spark2", "it broke")
    assert f.short == short and f.fix == "do the thing"


def test_ssh_ok_and_a_failure_without_a_fix_still_gets_one() -> None:
    assert C.rule_ssh("spark1", None).status == OK
    fails_with_fix(C.rule_ssh("spark1", NodeError("spark1", "error", "boom")), "spark1", "boom")


def test_changed_host_key_shows_the_fingerprint() -> None:
    err = NodeError("spark3", "hostkey-changed", "HOST KEY CHANGED ... offered ssh-ed25519 SHA256:abc",
                    "verify it, then run `sparkctl trust spark3`", key_type="ssh-ed25519", fingerprint="SHA256:abc")
    f = C.rule_ssh("spark3", err)
    fails_with_fix(f, "SHA256:abc")
    assert "sparkctl trust spark3" in f.fix


# ----------------------------------------------------------------------------------- docker, gpu


def test_docker_ok_from_captured_version() -> None:
    f = C.rule_docker("spark1", healthy())
    assert (f.status, f.short) == (OK, "20.10.24+dfsg1")


def test_docker_engine_down_from_captured_output() -> None:
    facts = healthy()
    facts.docker = F.parse_docker_version(fixture("docker/version-daemon-down.json"))
    facts.problems["docker-version"] = fixture("docker/version-daemon-down.stderr").strip().splitlines()[0]
    f = C.rule_docker("spark2", facts)
    fails_with_fix(f, "spark2", "not reachable", "Cannot connect")
    assert f.short == "engine down"


def test_docker_missing_and_too_old() -> None:
    facts = healthy()
    facts.docker = None
    facts.problems["docker-version"] = "command not found (sh: docker: not found)"
    fails_with_fix(C.rule_docker("n", facts), "command not found")
    facts.docker = F.DockerVersion("18.09", "18.09.1", "1.39", "linux", "arm64")
    fails_with_fix(C.rule_docker("n", facts), "1.39", "too old")


def test_gpu_ok_lists_name_driver_cuda() -> None:
    f = C.rule_gpu("spark1", healthy(), needs())
    assert (f.status, f.short) == (OK, "GB10")
    assert "driver 580.95.05" in f.text and "CUDA 13.0" in f.text


def test_gpu_missing_and_too_few() -> None:
    facts = healthy()
    facts.gpus = None
    facts.problems["gpu"] = "command not found (nvidia-smi: not found)"
    fails_with_fix(C.rule_gpu("spark4", facts, needs()), "spark4", "no GPU", "nvidia-smi")
    fails_with_fix(C.rule_gpu("spark4", healthy(), needs(gpus_per_node=2)), "GPUS_PER_NODE is 2")


# ---------------------------------------------------------------------------------- memory, limits


def test_memory_from_meminfo_and_unreadable() -> None:
    f = C.rule_memory("spark1", healthy())
    assert f.status == OK and "available" in f.text
    facts = healthy()
    facts.meminfo = None
    facts.problems["meminfo"] = "no MemTotal line in /proc/meminfo"
    fails_with_fix(C.rule_memory("spark1", facts), "spark1", "no MemTotal")


# Memory judged against the plan. The numbers are the real meminfo of a host whose page
# cache holds ~5.3 GiB (tests/fixtures/host/proc-meminfo-cache.txt): 17.3 GiB free.
CACHE_MEMINFO = "host/proc-meminfo-cache.txt"
OTHER_CID = "c0" * 32
OURS_CID = "0a" * 32


def _mem_facts(apps: str = "", containers: list[F.Container] | None = None, meminfo: str = CACHE_MEMINFO) -> F.NodeFacts:
    facts = healthy()
    facts.meminfo = F.parse_meminfo(fixture(meminfo))
    facts.gpu_apps = F.parse_compute_apps(apps)
    facts.containers = containers or []
    return facts


def _needing(need: int) -> Plan:
    """A real plan whose per-rank total is `need` bytes."""
    p = _plan()
    return replace(p, weights_per_rank=need - p.kv_cache_memory_bytes - p.overhead_bytes)


def _ours(state: str = "running") -> F.Container:
    return F.Container(OURS_CID, "sparkctl-sparkctl-rank0", "img", state, "Up", {"sparkctl.cluster": "sparkctl"})


def test_memory_ok_when_the_plan_fits_in_free_memory() -> None:
    facts = _mem_facts()
    free = facts.meminfo.free_bytes  # type: ignore[union-attr]
    f = C.rule_memory("spark1", facts, _needing(free - GB), needs())
    assert f.status == OK, f
    assert "page cache" in f.text and "free" in f.text


def test_memory_warns_when_only_the_page_cache_stands_in_the_way() -> None:
    facts = _mem_facts()
    free = facts.meminfo.free_bytes  # type: ignore[union-attr]
    f = C.rule_memory("spark2", facts, _needing(free + 2 * GB), needs())
    assert f.status == WARN, f
    assert "spark2" in f.text and "5.7 GB page cache" in f.text and "NV_ERR_NO_MEMORY" in f.text
    assert "echo 3 > /proc/sys/vm/drop_caches" in f.fix and "DROP_CACHES" in f.fix and "spark2" in f.fix


def test_memory_fails_naming_the_other_gpu_process_in_its_container() -> None:
    """GB10: a foreign container's process holds memory ([N/A] size, as a GB10 prints): nothing the
    cache can give back covers the plan -> FAIL, the pid, name and container named in the fix."""
    apps = fixture("nvidia-smi-gb10/compute-apps-noheader-nounits.csv") + f"@@cgroup 446 {OTHER_CID}\n"
    facts = _mem_facts(apps)
    m = facts.meminfo
    assert m is not None and m.free_bytes is not None and m.cache_bytes is not None
    f = C.rule_memory("spark3", facts, _needing(m.free_bytes + m.cache_bytes + GB), needs())
    fails_with_fix(f, "spark3", "pid 446 python3", OTHER_CID[:12], "`up` refuses to start next to it")
    assert f"docker stop {OTHER_CID[:12]}" in f.fix and "spark3" in f.fix


def test_memory_this_clusters_engine_is_given_back_not_counted() -> None:
    """A GPU process in this cluster's own container: up stops it, so its memory counts as free;
    the same process in a foreign container is a failure."""
    facts = _mem_facts(f"446, python3, 10758\n@@cgroup 446 {OURS_CID}\n", [_ours()])
    m = facts.meminfo
    assert m is not None and m.free_bytes is not None and m.cache_bytes is not None
    need = m.free_bytes + 10758 * 2**20 + 2 * GB  # the 10.5 GiB the engine gives back, then 2 GB of cache
    assert C.rule_memory("n", facts, _needing(need), needs()).status == WARN  # the cache still in the way
    ok = C.rule_memory("n", facts, _needing(m.free_bytes + 5 * GB), needs())
    assert ok.status == OK and "other GPU processes" not in ok.text  # its own engine is not "other"
    foreign = _mem_facts(f"446, python3, 10758\n@@cgroup 446 {OTHER_CID}\n")
    assert C.rule_memory("n", foreign, _needing(need), needs()).status == FAIL


def test_memory_own_engine_running_unitemized_is_a_warning() -> None:
    """This cluster's engine runs but nvidia-smi does not list it: not judged a failure (up stops it)."""
    facts = _mem_facts("", [_ours()])
    m = facts.meminfo
    assert m is not None and m.free_bytes is not None and m.cache_bytes is not None
    f = C.rule_memory("n", facts, _needing(m.free_bytes + m.cache_bytes + GB), needs())
    assert f.status == WARN and "this cluster's engine" in f.text
    facts.containers = [_ours("exited")]
    assert C.rule_memory("n", facts, _needing(m.free_bytes + m.cache_bytes + GB), needs()).status == FAIL


def test_memory_discrete_gpu_other_process() -> None:
    """H200 (memory.total known): page cache is host memory and does not matter; the other process's
    10.5 GiB counts against the GPU's 140 GiB."""
    facts = _mem_facts(fixture("nvidia-smi-h200-process/compute-apps.csv"))
    facts.gpus = F.parse_nvidia_smi_query(fixture("nvidia-smi-h200/query.csv"))
    fails_with_fix(C.rule_memory("h1", facts, _needing(145 * GB), needs()), "h1", "pid 446 python3", "11.3 GB")
    # Even where it would fit: up refuses to start next to a process it did not start, so check fails.
    fails_with_fix(C.rule_memory("h1", facts, _needing(50 * GB), needs()), "h1", "pid 446 python3", "refuses")
    facts.gpu_apps = []
    free = facts.meminfo.free_bytes  # type: ignore[union-attr]
    assert C.rule_memory("h1", facts, _needing(free + 50 * GB), needs()).status == OK  # page cache irrelevant


def test_memory_swap_in_use_warns_and_no_plan_is_not_judged() -> None:
    facts = _mem_facts()
    facts.meminfo = replace(facts.meminfo, swap_used_bytes=2 * GB)  # type: ignore[type-var]
    f = C.rule_memory("n", facts, _needing(GB), needs())
    assert f.status == WARN and "swap" in f.text
    facts = _mem_facts()
    f = C.rule_memory("n", facts, None, needs())
    assert f.status == OK and "not judged" in f.text
    facts.gpu_apps = None
    facts.problems["gpu-apps"] = "command not found (nvidia-smi)"
    assert "other GPU processes unknown" in C.rule_memory("n", facts, _needing(GB), needs()).text


def test_limits_ok_with_unlimited_memlock() -> None:
    assert C.rule_limits("spark1", healthy(), needs()).status == OK


def test_nofile_below_the_recipe() -> None:
    facts = healthy()
    facts.nofile_hard = 20000
    f = C.rule_limits("spark2", facts, needs())
    fails_with_fix(f, "spark2", "20000 < ULIMIT_NOFILE=1048576", "Too many open files")
    assert "ULIMIT_NOFILE" in f.fix


def test_memlock_below_unlimited_and_below_bytes() -> None:
    facts = healthy()
    facts.memlock_hard_kib = 8192
    fails_with_fix(C.rule_limits("n", facts, needs()), "8192 KiB < ULIMIT_MEMLOCK (unlimited)")
    assert C.rule_limits("n", facts, needs(memlock_bytes=8192 * 1024)).status == OK
    fails_with_fix(C.rule_limits("n", facts, needs(memlock_bytes=8192 * 1024 + 1)), "memlock")


def test_limits_unreadable() -> None:
    facts = healthy()
    facts.nofile_hard = None
    facts.problems["nofile"] = "exit status 2"
    fails_with_fix(C.rule_limits("n", facts, needs()), "could not read nofile")


# --------------------------------------------------------------------- fabric (beyond test_nic_pins.py)


def _fabric_facts(ip: str = "10.232.0.12", gid: int = 5) -> F.NodeFacts:
    mapped = "0000:0000:0000:0000:0000:ffff:" + "{:02x}{:02x}:{:02x}{:02x}".format(*map(int, ip.split(".")))
    up = ("BROADCAST", "MULTICAST", "UP", "LOWER_UP")
    return F.NodeFacts(
        netdevs=[F.NetDev("enp1s0f0np0", "UP", up, (ipaddress.IPv4Interface(f"{ip}/24"),))],
        hcas=[F.Hca("rocep1s0f0", ("enp1s0f0np0",), (F.IbPort(1, "ACTIVE", "Ethernet", (
            F.Gid(gid - 1, mapped, "IB/RoCE v1"), F.Gid(gid, mapped, "RoCE v2"))),))],
    )  # fmt: skip


def test_stale_gid_pin_is_replaced_with_a_warning() -> None:
    f, pins = discover_fabric("spark2", 1, _fabric_facts(), needs(given_pins=(RankPins(), RankPins(gid_index=3))))
    assert pins is not None and pins.gid_index == 5
    assert f.status == WARN and "RANK1_GID_INDEX=3" in f.text and "now 5" in f.text and f.fix


def test_stale_rdma_pin_and_pinned_fabric_ip() -> None:
    f, pins = discover_fabric("n", 0, _fabric_facts(), needs(given_pins=(RankPins(rdma_dev="mlx5_0"),)))
    assert pins is not None and f.status == WARN and "RANK0_CX7_IB=mlx5_0" in f.text
    f, pins = discover_fabric("n", 0, _fabric_facts(), needs(given_pins=(RankPins(fabric_ip="10.232.0.99"),)))
    assert pins is None
    fails_with_fix(f, "RANK0_FABRIC_IP=10.232.0.99")


def test_address_outside_the_fabric_subnet_is_not_taken() -> None:
    f, pins = discover_fabric("n", 0, _fabric_facts("192.168.1.5"), needs())
    assert pins is None
    fails_with_fix(f, "FABRIC_SUBNET=10.232.0.0/24", "192.168.1.5/24")


# -------------------------------------------------------------------------------------------- reach


@pytest.mark.skipif(not shutil.which("bash"), reason="the TCP test needs bash")
def test_reach_script_on_loopback() -> None:
    """A listener answers, a refusal is an answer too (the peer's kernel sent it), and a connect the
    kernel refuses at once is a failure with its reason -- all settled by the one unforked bash."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        r = subprocess.run(["sh", "-c", '. "$0"; reach_test "$@"', str(REACH), str(port), "127.0.0.1", "127.0.0.2",
                            "255.255.255.255"], capture_output=True, timeout=30)  # fmt: skip
    got = C.parse_reach(r.stdout.decode())
    assert got == {"127.0.0.1": "ok", "127.0.0.2": "ok", "255.255.255.255": "Network is unreachable"}, r


@pytest.mark.skipif(not shutil.which("bash") or not shutil.which("timeout"), reason="the TCP test needs bash")
def test_reach_script_without_mktemp_never_writes_through_a_planted_folder(tmp_path: Path) -> None:
    """With no mktemp, the slow round's scratch folder is made new and private (mkdir, not mkdir -p): one
    planted at the pid-named fallback in /tmp (a link to a folder whose files link to the user's) is not
    written through; the peers then fail with the reason."""
    import socket

    real_timeout = shutil.which("timeout")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "mktemp").write_text("#!/bin/sh\nexit 1\n")
    # the 1 s round settles nothing, so every peer goes to the slow round that uses the scratch folder
    (shims / "timeout").write_text(f'#!/bin/sh\n[ "$3" = 1 ] && exit 124\nexec {real_timeout} "$@"\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    canary = tmp_path / "canary"
    canary.write_bytes(b"precious\n")
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "127.0.0.1").symlink_to(canary)

    def plant() -> None:  # in the child, before exec: $$ is this pid
        Path(f"/tmp/sparkctl-reach.{os.getpid()}").symlink_to(evil)

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]  # bound, not listening: the connect is refused at once
        r = subprocess.run(["sh", "-c", '. "$0"; reach_test "$@"', str(REACH), str(port), "127.0.0.1"],
                           capture_output=True, timeout=30, preexec_fn=plant,
                           env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "TMPDIR": "/tmp"})
    try:
        assert canary.read_bytes() == b"precious\n", r
        assert (evil / "127.0.0.1").is_symlink() and sorted(p.name for p in evil.iterdir()) == ["127.0.0.1"]
        got = C.parse_reach(r.stdout.decode())
        assert list(got) == ["127.0.0.1"] and "temporary folder" in got["127.0.0.1"], r
    finally:
        for link in Path("/tmp").glob("sparkctl-reach.*"):
            if link.is_symlink() and link.resolve() == evil.resolve():
                link.unlink()


def _probe_round_one(tmp_path: Path, port: int) -> tuple[subprocess.Popen[bytes], str, bytes]:
    """node_facts.sh as check runs it: reach.sh ahead of it, reach=PORT, the input left open."""
    nonce = "0123456789abcdef"
    env = dict(os.environ, SPARKCTL_SYSFS_ROOT=str(tmp_path / "none"), PATH=os.environ["PATH"])
    args = F.probe_args(cluster="x", docker=False, banner=False, listening=False)
    proc = subprocess.Popen(["sh", "-s", "--", nonce, *args, f"reach={port}"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(REACH.read_bytes() + b"\n" + PROBE.read_bytes())
    proc.stdin.flush()
    out = b""
    ready = f"@@sparkctl {nonce} ready\n".encode()
    while ready not in out:  # bounded by the test's own timeout: the probe prints it or ends
        chunk = proc.stdout.read1(65536)
        assert chunk, f"the probe ended before round 2: {out!r}"
        out += chunk
    return proc, nonce, out


@pytest.mark.skipif(not shutil.which("bash"), reason="the TCP test needs bash")
def test_probe_runs_the_reach_test_as_round_two_on_the_same_input(tmp_path: Path) -> None:
    """Round 1: the facts, then "ready"; the caller answers with the peers' addresses on the same
    input; round 2 is the reach section. One process, one channel per node for the whole check."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        proc, nonce, first = _probe_round_one(tmp_path, listener.getsockname()[1])
        assert F.node_facts_from_probe(first.decode(), nonce, expect_banner=False, expect_docker=False,
                                       expect_listening=False, expect_model=False).meminfo  # fmt: skip
        rest, err = proc.communicate(b"127.0.0.1 255.255.255.255\n", timeout=30)
    sections = F.parse_probe_sections((first + rest).decode(), nonce, err.decode())
    assert C.parse_reach(sections["reach"].stdout) == {"127.0.0.1": "ok", "255.255.255.255": "Network is unreachable"}
    assert proc.returncode == 0


@pytest.mark.parametrize("reply", [b"", b"\n", b"$(touch canary) ;touch canary\n"])
def test_probe_round_two_reply_is_data_never_code(tmp_path: Path, reply: bytes) -> None:
    """No reply (the caller went away), an empty one (no fabric address): no test. A hostile one:
    addresses that fail, never a command run."""
    proc, nonce, first = _probe_round_one(tmp_path, 9)
    rest, err = proc.communicate(reply, timeout=30)
    assert proc.returncode == 0 and not (tmp_path / "canary").exists()
    sections = F.parse_probe_sections((first + rest).decode(), nonce, err.decode())
    if reply.strip():
        assert all(v != "ok" for v in C.parse_reach(sections["reach"].stdout).values())
    else:
        assert "reach" not in sections


def test_reach() -> None:
    peers = {"10.232.0.12": "spark2", "10.232.0.13": "spark3"}
    assert C.rule_reach("spark1", {"10.232.0.12": "ok", "10.232.0.13": "ok"}, peers).status == OK
    f = C.rule_reach("spark1", {"10.232.0.12": "ok", "10.232.0.13": "no answer within 3s"}, peers)
    fails_with_fix(f, "spark1 cannot reach spark3 (10.232.0.13: no answer within 3s)")
    assert "spark2" not in f.text
    assert C.rule_reach("spark1", {"10.232.0.12": "ok"}, peers).status == WARN
    assert C.rule_reach("spark1", None, peers).status == SKIP
    fails_with_fix(C.rule_reach("spark1", NodeError("spark1", "lost", "SSH connection lost"), peers), "lost")


# ------------------------------------------------------------------------------- ports, disk, ...


def test_api_port_taken_on_the_head_only() -> None:
    facts = healthy()
    facts.listeners = F.parse_listening_ports(fixture("host/ss-Hltn.txt") + "LISTEN 0 5 0.0.0.0:8888 0.0.0.0:*\n")
    f = C.rule_ports("spark1", facts, needs(), is_head=True)
    fails_with_fix(f, "spark1", "8888 PORT (the API)")
    assert "8888" in f.fix and "spark1" in f.fix
    assert C.rule_ports("spark2", facts, needs(), is_head=False).status == OK  # workers serve no API
    facts.listeners = F.parse_listening_ports("LISTEN 0 5 [::]:29501 [::]:*\n")
    fails_with_fix(C.rule_ports("spark1", facts, needs(), is_head=True), "29501 MASTER_PORT")
    assert C.rule_ports("spark1", healthy(), needs(), is_head=True).status == OK


def test_ports_unreadable() -> None:
    facts = healthy()
    facts.listeners = None
    facts.problems["listening"] = "command not found (ss)"
    fails_with_fix(C.rule_ports("spark1", facts, needs(), is_head=True), "command not found")
    # A worker is not asked (check probes with listening=no there): nothing to report, nothing missing.
    assert C.rule_ports("spark2", facts, needs(), is_head=False).status == OK


def test_workers_are_not_asked_for_the_heads_facts() -> None:
    worker = F.probe_args(cluster="c", banner=False, listening=False)
    assert "banner=no" in worker and "listening=no" in worker
    assert not {"banner=no", "listening=no"} & set(F.probe_args(cluster="c"))
    nonce = "0123456789abcdef"
    text = "".join(f"@@sparkctl {nonce} begin {n}\n\n@@sparkctl {nonce} end {n} 0\n" for n in ("nofile",))
    assert "listening" in F.node_facts_from_probe(text, nonce).problems
    assert "listening" not in F.node_facts_from_probe(text, nonce, expect_listening=False).problems


def test_disk_levels_take_the_fullest_path() -> None:
    facts = healthy()
    assert C.rule_disk("n", facts).status == OK
    facts.disks = [F.DiskUsage("a", 100 * GB, 0, 300 * GB, "/"), F.DiskUsage("b", 100 * GB, 0, 20 * GB, "/var")]
    f = C.rule_disk("n", facts)
    assert f.status == WARN and "/var" in f.text and f.fix
    facts.disks = [F.DiskUsage("b", 100 * GB, 0, 5 * GB, "/var/lib/docker")]
    fails_with_fix(C.rule_disk("n", facts), "5.0 GB free on /var/lib/docker")
    facts.disks = None
    fails_with_fix(C.rule_disk("n", facts), "could not read df")


def test_containers_running_stale_none() -> None:
    facts = healthy()
    assert C.rule_containers("n", facts, needs()).status == OK
    facts.containers = F.parse_docker_ps(fixture("docker/ps-a.jsonl"))
    stale = C.rule_containers("n", facts, needs())
    assert stale.status == WARN and "sparkctl-rank0" in stale.text and stale.fix
    facts.containers = [F.Container("abc", "sparkctl-sparkctl-rank0", "img", "running", "Up 2 hours", {})]
    fails_with_fix(C.rule_containers("spark1", facts, needs()), "spark1", "sparkctl-sparkctl-rank0 (running)")
    facts.containers = None
    fails_with_fix(C.rule_containers("n", facts, needs()), "could not read docker-ps")


# -------------------------------------------------------------------------------------------- plan


def _settings(**env: str) -> Settings:
    return load_settings(environ={"NODES": " ".join(NODES), "MODEL": "/models/x", **env})


def _ckpt(total: int) -> CheckpointInfo:
    return CheckpointInfo(Path("/models/x"), GLM53_CONFIG, (Shard("a.safetensors", total),), total)


def _plan(total: int = 308 * GB, mem: int = 128 * GB, **env: str) -> Plan:
    return make_plan(_settings(**env), _ckpt(total), mem)


def test_plan_fits_does_not_fit_and_not_made() -> None:
    assert C.rule_plan("n", healthy(), _plan()).status == OK
    f = C.rule_plan("spark3", healthy(), _plan(mem=64 * GB))
    fails_with_fix(f, "spark3", "does not fit")
    assert "MAX_MODEL_LEN" in f.fix
    assert C.rule_plan("n", healthy(), None, "no config.json").status == WARN


def test_gpu_memory_utilization_under_the_cap() -> None:
    assert C.rule_gpu_memory_utilization(None) is None
    ok = C.rule_gpu_memory_utilization(_plan())
    assert ok is not None and ok.status == OK and ok.node == C.CLUSTER_ROW
    over = C.rule_gpu_memory_utilization(_plan(GPU_MEMORY_UTILIZATION="0.9"))
    assert over is not None
    fails_with_fix(over, "GPU_MEMORY_UTILIZATION=0.9", "cap 0.82")
    assert "0.82" in over.fix


# --------------------------------------------------------------------------------- model folder


def listing(shards: dict[str, int]) -> F.ModelListing:
    return F.ModelListing(True, {**shards, "config.json": 900, "serving/exl3.py": 10})


def test_same_model_everywhere() -> None:
    got = C.rule_model({n: listing(SHARDS) for n in NODES}, "spark1", "/models/lab", {})
    assert [f.status for f in got.values()] == [OK] * 4
    assert got["spark2"].short == "3 shards"


def test_nfs_self_mount_gotcha_names_the_node_and_the_shards() -> None:
    # spark1 (the NFS server) did not bind-mount its export at MODEL: it sees another folder.
    other = {"model-00001-of-00003.safetensors": 1_000_000, "model-00002-of-00003.safetensors": 7}
    got = C.rule_model({"spark1": listing(other), **{n: listing(SHARDS) for n in NODES[1:]}},
                       "spark1", "/models/lab", {})  # fmt: skip
    for n in NODES[1:]:
        assert got[n].status == OK  # the majority is the reference, even against the head
    f = got["spark1"]
    fails_with_fix(f, "spark1", "/models/lab", "missing: model-00003-of-00003.safetensors",
                   "different size: model-00002-of-00003.safetensors")
    assert "spark1" in f.fix and "mount" in f.fix


def test_extra_shard_and_tie_prefers_the_head() -> None:
    more = {**SHARDS, "model-00004-of-00003.safetensors": 5}
    got = C.rule_model({"spark1": listing(SHARDS), "spark2": listing(more)}, "spark1", "/m", {})
    assert got["spark1"].status == OK
    fails_with_fix(got["spark2"], "extra: model-00004-of-00003.safetensors")


def test_model_missing_empty_unreadable() -> None:
    got = C.rule_model(
        {"spark1": listing(SHARDS), "spark2": F.ModelListing(False, {}),
         "spark3": F.ModelListing(True, {"config.json": 3}), "spark4": None},
        "spark1", "/models/lab", {"spark4": "find: permission denied"},
    )  # fmt: skip
    assert got["spark1"].status == OK
    fails_with_fix(got["spark2"], "spark2", "MODEL=/models/lab does not exist")
    fails_with_fix(got["spark3"], "no *.safetensors")
    fails_with_fix(got["spark4"], "spark4", "permission denied")


def test_long_differences_are_cut_short() -> None:
    many = {f"s{i:02d}.safetensors": 1 for i in range(10)}
    got = C.rule_model({"a": listing(many), "b": listing(many), "c": listing({})}, "a", "/m", {})
    assert got["c"].status == FAIL  # no shards at all
    got = C.rule_model({"a": listing(many), "b": listing(many), "c": listing({"s00.safetensors": 1})}, "a", "/m", {})
    assert "…" in got["c"].text and got["c"].text.count(".safetensors") == 4


# --------------------------------------------------------------------------------------- image


def image(id_: str, layers: tuple[str, ...] = ("sha256:l1", "sha256:l2")) -> F.Image:
    return F.Image(f"sha256:{id_}", ("sparkctl-lab/engine:latest",), {}, layers)


def test_same_image_on_every_rank() -> None:
    got = C.rule_image({n: [image("a" * 64)] for n in NODES}, "spark1", "sparkctl-lab/engine:latest", {})
    assert {f.status for f in got.values()} == {OK} and got["spark3"].short == "a" * 12


def test_differing_image_ids_across_ranks() -> None:
    imgs = {n: [image("a" * 64)] for n in NODES}
    imgs["spark3"] = [image("b" * 64, ("sha256:l1", "sha256:l9"))]
    got = C.rule_image(imgs, "spark1", "sparkctl-lab/engine:latest", {})
    assert [got[n].status for n in NODES] == [OK, OK, FAIL, OK]
    fails_with_fix(got["spark3"], "spark3", "bbbbbbbbbbbb", "aaaaaaaaaaaa", "different layers")
    assert "sparkctl build" in got["spark3"].fix
    imgs["spark3"] = [image("c" * 64)]
    got = C.rule_image(imgs, "spark1", "sparkctl-lab/engine:latest", {})
    assert "same layers, different image config" in got["spark3"].text


def test_the_head_is_the_odd_one_out() -> None:
    imgs = {n: [image("a" * 64)] for n in NODES}
    imgs["spark1"] = [image("d" * 64)]
    got = C.rule_image(imgs, "spark1", "sparkctl-lab/engine:latest", {})
    assert got["spark1"].status == FAIL and all(got[n].status == OK for n in NODES[1:])


def test_image_missing_or_unreadable() -> None:
    inspected = F.parse_image_inspect(fixture("docker/image-inspect.json"))
    got = C.rule_image({"spark1": inspected, "spark2": [], "spark3": None}, "spark1", "nothere:1",
                       {"spark3": "Cannot connect to the Docker daemon"})  # fmt: skip
    assert got["spark1"].status == WARN and got["spark2"].status == WARN and "sparkctl build" in got["spark2"].fix
    fails_with_fix(got["spark3"], "spark3", "Cannot connect")


# --------------------------------------------------------------------------------- checkpoint


def test_checkpoint_verification() -> None:
    assert C.rule_checkpoint(None, None) == []
    (f,) = C.rule_checkpoint(None, "python3 is not installed on the head")
    assert f.status == WARN and "python3" in f.text and f.fix
    good = Report([], Summary(shards=3, tensors=120, quantized_by_bits={3: 96}))
    (f,) = C.rule_checkpoint(good, None)
    assert f.status == OK and "3 shards" in f.short and "96 × 3-bit" in f.text
    bad = Report([issue(FAIL, "missing-shard", "model-00002 is missing", ""),
                  issue(WARN, "codebook", "codebooks are mixed", "use mul1")], Summary())
    err, warn = C.rule_checkpoint(bad, None)
    fails_with_fix(err, "model-00002 is missing")  # a verifier finding without a fix still gets one
    assert warn.status == WARN and warn.fix == "use mul1"


def _scan(index: bool = True, **extra: Any) -> dict[str, Any]:
    def blob(obj: Any) -> dict[str, Any]:
        return {"data": _encode(json.dumps(obj).encode(), "zlib")}

    files = {**{n: {"size": s, "mtime_ns": 1} for n, s in SHARDS.items()}, "serving/exl3.py": {"size": 3}}
    js: dict[str, Any] = {"config.json": blob(GLM53_CONFIG), "quantization_config.json": {"missing": True}}
    js["model.safetensors.index.json"] = (
        blob({"metadata": {"total_size": 6_000_000}, "weight_map": {f"t{i}": n for i, n in enumerate(SHARDS)}})
        if index else {"missing": True}
    )  # fmt: skip
    return {"files": files, "json": js, **extra}


def test_checkpoint_from_scan() -> None:
    from sparkctl.spec.planner import checkpoint_from_scan

    info = checkpoint_from_scan(_scan(), Path("/models/lab"), "spark1")
    assert info.config["kv_lora_rank"] == 512 and info.index_total_size == 6_000_000
    assert [(s.name, s.size) for s in info.shards] == sorted(SHARDS.items())
    no_index = checkpoint_from_scan(_scan(index=False), Path("/models/lab"), "spark1")
    assert [s.name for s in no_index.shards] == sorted(SHARDS) and no_index.index_total_size is None
    summarised = _scan()  # the index as the head's summary (check's scan) gives the same plan input
    summarised["json"]["model.safetensors.index.json"] = {"summary": {
        "weight_map": True, "total_size": 6_000_000, "shards": {n: {"count": 1} for n in SHARDS}}}
    assert checkpoint_from_scan(summarised, Path("/models/lab"), "spark1") == info


def test_checkpoint_from_scan_refuses() -> None:
    from sparkctl.errors import CheckFailed, UsageError
    from sparkctl.spec.planner import checkpoint_from_scan

    with pytest.raises(UsageError, match="not a folder on spark1"):
        checkpoint_from_scan({"error": {"code": "dir-missing", "message": "/m is not a folder"}}, Path("/m"), "spark1")
    scan = _scan()
    scan["json"]["config.json"] = {"missing": True}
    with pytest.raises(UsageError, match="config.json not found in /m on spark1"):
        checkpoint_from_scan(scan, Path("/m"), "spark1")
    with pytest.raises(CheckFailed, match="spark1"):
        checkpoint_from_scan({"error": "boom"}, Path("/m"), "spark1")


# ------------------------------------------------------------------------------ every failure


def test_evaluate_skips_an_unreachable_node_and_fixes_every_failure() -> None:
    n1, n2 = healthy(), healthy()
    n1.images, n2.images, n2.nofile_hard = [image("a" * 64)], [image("b" * 64)], 20000
    gathered: dict[str, Any] = {
        "spark1": (n1, None), "spark2": (n2, None), "spark3": (NodeError("spark3", "lost", "gone", "x"), None)
    }  # fmt: skip
    nodes = ["spark1", "spark2", "spark3", "spark4"]
    refused = NodeError("spark4", "refused", "connection refused", "start sshd")
    findings, pins = C.evaluate(nodes, needs(), gathered, {"spark4": refused}, lambda f: (None, "no ckpt"), None)
    by = {(f.node, f.check): f for f in findings}
    assert by[("spark4", "ssh")].status == FAIL and by[("spark4", "docker")].status == SKIP
    assert by[("spark3", "ssh")].short == "lost"
    assert by[("spark2", "limits")].status == FAIL
    assert by[("spark1", "image")].status == OK and by[("spark2", "image")].status == FAIL  # a tie: the head wins
    assert by[("spark1", "plan")].status == WARN and "no ckpt" in by[("spark1", "plan")].text
    for f in findings:
        if f.status == FAIL:
            assert f.fix and "\n" not in f.fix, f


def test_engine_down_is_one_failure_not_three() -> None:
    down = healthy()
    down.docker, down.images, down.containers = None, None, None
    down.problems.update(dict.fromkeys(F.DOCKER_SECTIONS, "cannot connect to the Docker engine"))
    gathered: dict[str, Any] = {"spark1": (healthy(), None), "spark2": (down, None)}
    findings, _ = C.evaluate(["spark1", "spark2"], needs(), gathered, {}, lambda f: (None, "-"), None)
    failed = [(f.node, f.check) for f in findings if f.status == FAIL and f.check != "fabric"]
    assert failed == [("spark2", "docker")]  # (these facts have no fabric at all)
    by = {(f.node, f.check): f for f in findings}
    assert by[("spark2", "image")].status == SKIP and by[("spark2", "containers")].status == SKIP


def test_evaluate_judges_each_nodes_memory_against_its_plan() -> None:
    """Check's memory row gets the node's plan: a node whose page cache stands in the way
    warns, a node with room is OK, in one evaluation."""
    tight, roomy = _mem_facts(), _mem_facts()
    free = tight.meminfo.free_bytes  # type: ignore[union-attr]
    roomy.meminfo = replace(roomy.meminfo, free_bytes=free + 10 * GB)  # type: ignore[type-var]
    gathered: dict[str, Any] = {"spark1": (tight, None), "spark2": (roomy, None)}
    findings, _ = C.evaluate(["spark1", "spark2"], needs(), gathered, {}, lambda f: (_needing(free + 2 * GB), ""), None)
    by = {(f.node, f.check): f.status for f in findings}
    assert by[("spark1", "memory")] == WARN and by[("spark2", "memory")] == OK




# ------------------------------------------------------------------------------ the command


def _report(*, fail: bool, settings: Settings) -> CheckReport:
    findings = [C._f(n, c, OK, "ok") for n in NODES for c in C.CHECKS]
    findings.append(C._f("spark2", "disk", WARN, "40.0 GB", "spark2: 40.0 GB free [red]x[/]", "free space"))
    if fail:
        findings.append(C._f("spark3", "limits", FAIL, "too low", "spark3: hard nofile limit 20000 < 1048576",
                             "raise the hard limits on spark3"))  # fmt: skip
    pins = {
        r: RankPins(fabric_ip=f"10.232.0.{11 + r}", netdev="enp1s0f1np1" if r == 2 else "enp1s0f0np0",
                    rdma_dev="rocep1s0f1" if r == 2 else "rocep1s0f0", gid_index=5 if r == 1 else 3)
        for r in range(4)
    }  # fmt: skip
    plan = make_plan(settings, _ckpt(6_000_000), 128 * GB)
    return CheckReport(list(NODES), findings, pins, plan, {}, {"total": 0.5})


@pytest.fixture
def command_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.chdir(tmp_path)
    for k in ("SPARKCTL_ENV_FILE", "SPARKCTL_SSH_CONFIG", "NODES", "MODEL", "RECIPE", "TP"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NODES", " ".join(NODES))
    monkeypatch.setenv("MODEL", "/models/lab")
    monkeypatch.setenv("RECIPE", "lab")
    return tmp_path


def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
            fail: bool = False) -> tuple[int, str, str]:  # fmt: skip
    from sparkctl.cli import main
    from sparkctl.commands import check as cmd

    monkeypatch.setattr(cmd, "run_check", lambda s, *a, **k: _report(fail=fail, settings=s))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_command_only_warnings_exits_0_and_writes_env_tp4(command_env: Path, monkeypatch, capsys) -> None:
    code, out, _ = run_cli(monkeypatch, capsys, ["check"])
    assert code == 0
    assert "✓" in out and "! 40.0 GB" in out and "warnings:" in out and "fix: free space" in out
    assert "[red]x[/]" in out  # node output is data, not markup
    env = (command_env / "env" / "env.tp4").read_text()
    assert "enp1s0f1np1" in env and "rocep1s0f1" in env
    assert oct((command_env / "env" / "env.tp4").stat().st_mode & 0o777) == "0o600"


def test_command_failure_exits_1_with_the_fix_and_no_env_tp4(command_env: Path, monkeypatch, capsys) -> None:
    code, out, err = run_cli(monkeypatch, capsys, ["check"], fail=True)
    assert code == 1
    assert "✗ too low" in out and "fix: raise the hard limits on spark3" in out
    assert "check failed: 1 problem(s) on spark3" in err
    assert not (command_env / "env" / "env.tp4").exists()
    code, _, _ = run_cli(monkeypatch, capsys, ["check", "--render"], fail=True)
    assert code == 1 and (command_env / "env" / "env.tp4").exists()


def test_command_json_is_one_document(command_env: Path, monkeypatch, capsys) -> None:
    code, out, _ = run_cli(monkeypatch, capsys, ["--json", "check"], fail=True)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["nodes"] == NODES
    failed = [f for f in doc["findings"] if f["status"] == "fail"]
    assert failed == [{"node": "spark3", "check": "limits", "status": "fail", "short": "too low",
                       "reason": "spark3: hard nofile limit 20000 < 1048576",
                       "fix": "raise the hard limits on spark3"}]  # fmt: skip
    assert doc["pins"]["2"] == {"node": "spark3", "fabric_ip": "10.232.0.13", "netdev": "enp1s0f1np1",
                                "rdma_dev": "rocep1s0f1", "gid_index": 3}  # fmt: skip
    assert doc["env_tp4"] is None and doc["plan"]["kv_cache_memory_bytes"] > 0
    code, out, _ = run_cli(monkeypatch, capsys, ["--json", "check"])
    assert code == 0 and json.loads(out)["env_tp4"] == "env/env.tp4"


@pytest.mark.parametrize(
    "argv_env",
    [
        (["check", "--timeout", "0"], {}),
        (["check"], {"NODES": "spark1 'a;touch /tmp/x' spark3 spark4"}),
        (["check"], {"NODES": "spark1 $(touch) spark3 spark4"}),
        (["check"], {"MODEL": "models/relative"}),
        (["check"], {"NODES": "spark1 spark2"}),  # TP=4 needs four nodes
    ],
)
def test_command_bad_input_exits_2(command_env: Path, monkeypatch, capsys, argv_env) -> None:
    argv, env = argv_env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = run_cli(monkeypatch, capsys, argv)
    assert code == 2 and out == "" and "error" in err.lower()


# ----------------------------------------------------- the facts check gathers (docker API, banner)


class _Engine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _engine_handler(image_id: str, asked: list[str]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        # What dockerd puts on every answer: "Server: Docker/27.5.1 (linux)", "Api-Version: 1.47".
        server_version, sys_version = "Docker/27.5.1", "(linux)"

        def address_string(self) -> str:  # a unix socket has no client address
            return "local"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urllib.parse.urlsplit(self.path)
            asked.append(url.path)
            body: Any
            if url.path == "/containers/json":
                labels = json.loads(urllib.parse.parse_qs(url.query)["filters"][0])["label"]
                code, body = 200, [{"Id": "c1", "Names": ["/sparkctl-x-rank0"], "Image": "img", "State": "exited",
                                    "Status": "Exited (0)", "Labels": {"sparkctl.cluster": labels[0].split("=")[1]}}]
            elif url.path == "/images/lab/engine:1/json":
                code, body = 200, {"Id": image_id, "RepoTags": ["lab/engine:1"], "RootFS": {"Layers": ["sha256:l"]}}
            else:
                code, body = 404, {"message": f"No such image: {url.path}"}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Api-Version", "1.47")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.mark.skipif(not shutil.which("curl"), reason="needs curl")
def test_probe_asks_the_engine_api_with_one_curl(tmp_path: Path) -> None:
    sock = tmp_path / "docker.sock"
    asked: list[str] = []
    server = _Engine(str(sock), _engine_handler("sha256:" + "e" * 64, asked))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        nonce = "0123456789abcdef"
        args = F.probe_args(cluster="x", images=["lab/engine:1"], api=True, banner=False, df_paths=["/"])
        env = dict(os.environ, DOCKER_HOST=f"unix://{sock}", SPARKCTL_SYSFS_ROOT=str(tmp_path / "none"),
                   PATH=f"{tmp_path}:{os.environ['PATH']}")  # fmt: skip
        r = subprocess.run(["sh", "-s", "--", nonce, *args], input=PROBE.read_bytes(), capture_output=True,
                           env=env, timeout=60)  # fmt: skip
        out, err = r.stdout.decode(), r.stderr.decode()
    finally:
        server.shutdown()
        server.server_close()
    assert f"@@sparkctl {nonce} begin docker-version" not in out  # no docker CLI runs
    assert asked == ["/containers/json", "/images/lab/engine:1/json"]  # no GET /version: headers say it
    facts = F.node_facts_from_probe(out, nonce, err, expect_banner=False, expect_model=False)
    assert facts.docker == F.DockerVersion(None, "27.5.1", "1.47", "linux", None)
    assert facts.containers == [F.Container("c1", "sparkctl-x-rank0", "img", "exited", "Exited (0)",
                                            {"sparkctl.cluster": "x"})]  # fmt: skip
    assert facts.images and facts.images[0].id == "sha256:" + "e" * 64
    assert not {k for k in facts.problems if k.startswith("docker")} and "gpu-banner" not in facts.problems


def test_docker_api_section_engine_down_missing_image_and_errors() -> None:
    nonce = "0123456789abcdef"

    def section(stdout: str, rc: int = 0, stderr: str = "") -> F.DockerFacts:
        return F.docker_facts_from_api(F.Section("docker-api", stdout, stderr, rc), nonce)

    def reply(code: int, body: str) -> str:
        return f"{body}\n@@sparkctl {nonce} http {code}\n"

    down = section("socket unix:///run/docker.sock\n" + reply(0, "") * 3, 7,
                   "curl: (7) Failed to connect to docker port 80 after 0 ms: Couldn't connect to server")  # fmt: skip
    assert down.version is None and down.images is None
    assert down.problems["docker-version"].startswith("cannot connect to the Docker engine at unix:///run/docker.sock")
    headers = "HTTP/1.1 {code} X\r\nApi-Version: 1.41\r\nServer: Docker/20.10.24+dfsg1 (linux)\r\n\r\n"
    got = section("socket unix:///s\n" + reply(500, headers.format(code=500) + '{"message": "boom"}')
                  + reply(404, headers.format(code=404) + '{"message": "No such image"}'))  # fmt: skip
    assert got.version == F.DockerVersion(None, "20.10.24+dfsg1", "1.41", "linux", None)
    assert got.containers is None and got.problems["docker-ps"] == "HTTP 500: boom"
    assert got.images == []  # missing: a warning for rule_image, not an error
    forged = headers.format(code=200) + "[]\n" + reply(200, "[]").replace(nonce, "f" * 16)  # another nonce: body
    assert section("socket unix:///s\n" + reply(200, forged) + reply(404, "")).problems["docker-ps"].startswith("not JSON")
    # An engine that answers without a Server header (a Docker API look-alike) is still up.
    bare = section("socket unix:///s\n" + reply(200, "HTTP/1.1 200 OK\r\n\r\n[]") + reply(404, ""))
    assert bare.version is not None and bare.version.server_version == "unknown (no Server header)"
    assert bare.containers == [] and not bare.problems


def test_api_paths_are_percent_encoded() -> None:
    paths = F.docker_api_paths("c;$(x)", "reg.io:5000/a/b:1@sha256:00")
    assert len(paths) == 2 and paths[0].startswith("/containers/json?all=1&filters=")
    assert "%24%28x%29" in paths[0] and "$(" not in paths[0] and " " not in paths[0]
    assert paths[1] == "/images/reg.io:5000/a/b:1@sha256:00/json"
    assert F.probe_args(cluster="c", images=["i:1"], api=True)[1:] == [f"api={p}" for p in F.docker_api_paths("c", "i:1")] + ["image=i:1"]


def test_cuda_version_comes_from_the_head_for_the_same_driver() -> None:
    head, same, other = healthy(), healthy(), healthy()
    same.gpu_banner = other.gpu_banner = None  # workers are not asked for the banner
    other.gpus = F.parse_nvidia_smi_query("NVIDIA GB10, 570.10, [N/A], 12.1, 1\n")
    assert "CUDA 13.0" in C.rule_gpu("spark2", same, needs(), head).text
    f = C.rule_gpu("spark3", other, needs(), head)
    assert f.status == WARN and "570.10" in f.text and "580.95.05" in f.fix
    assert "CUDA" not in C.rule_gpu("spark2", same, needs(), None).text


def test_image_content_hash_makes_separate_builds_equal() -> None:
    def built(id_: str, content: str) -> F.Image:
        return F.Image(f"sha256:{id_ * 64}", ("c:keys3",), {"sparkctl.content-hash": content}, ("sha256:l",))

    imgs = {"spark1": [built("a", "h1")], "spark2": [built("b", "h1")], "spark3": [built("c", "h2")]}
    got = C.rule_image(imgs, "spark1", "c:keys3", {})
    assert got["spark1"].status == OK and got["spark2"].status == OK and "content h1" in got["spark2"].text
    fails_with_fix(got["spark3"], "spark3", "cccccccccccc")


def test_open_api_is_a_cluster_warning_with_a_fix() -> None:
    from sparkctl.rules.check_rules import CLUSTER_ROW, WARN, rule_open_api

    assert rule_open_api(None) is None
    f = rule_open_api("the API on spark1:8888 will listen on 0.0.0.0 without an API key")
    assert f is not None and f.node == CLUSTER_ROW and f.status == WARN and "VLLM_API_KEY" in f.fix


def test_docker_api_asks_for_every_image_and_reads_each_answer() -> None:
    """IMAGE and BASE_IMAGE both (the base rule needs the second): one API path and one answer each."""
    nonce = "0123456789abcdef"
    paths = F.docker_api_paths("c", "sparkctl/glm53-exl3:keys3", "ghcr.io/miaai-lab/x:exl3")
    assert paths[1:] == ["/images/sparkctl/glm53-exl3:keys3/json", "/images/ghcr.io/miaai-lab/x:exl3/json"]
    assert F.probe_args(cluster="c", images=["a:1", "b:2"], api=True)[1:4] == [f"api={p}" for p in F.docker_api_paths("c", "a:1", "b:2")]
    ok = "HTTP/1.1 200 OK\r\nServer: Docker/20.10.24+dfsg1 (linux)\r\n\r\n"

    def reply(code: int, body: str) -> str:
        return f"{body}\n@@sparkctl {nonce} http {code}\n"

    base = {"Id": "sha256:" + "b" * 64, "RepoTags": ["ghcr.io/miaai-lab/x:exl3"], "RepoDigests": [], "Config": {},
            "RootFS": {"Layers": []}}
    got = F.docker_facts_from_api(F.Section("docker-api", "socket unix:///s\n" + reply(200, ok + "[]")
                                            + reply(404, ok.replace("200 OK", "404 X") + '{"message": "No such image"}')
                                            + reply(200, ok + json.dumps(base)), "", 0), nonce)  # fmt: skip
    assert got.images is not None and [i.id for i in got.images] == [base["Id"]] and not got.problems


# ------------------------------------------------------------------ a recipe pin that wins over a rank's


@pytest.mark.parametrize(("value", "device", "named"), [
    ("rocep1s0f0", "rocep1s0f0", True), ("rocep1s0f0", "rocep1s0f1", False),
    ("rocep1s0f", "rocep1s0f1", True),  # a prefix, as NCCL reads it
    ("=rocep1s0f", "rocep1s0f1", False),  # `=`: exact names only
    ("rocep1s0f0:1,rocep1s0f1:1", "rocep1s0f1", True),  # a list with ports
    ("^rocep1s0f0", "rocep1s0f1", True), ("^=rocep1s0f1", "rocep1s0f1", False),  # exclusions
])
def test_an_nccl_device_list_is_read_as_nccl_reads_it(value: str, device: str, named: bool) -> None:

    assert _names_device(value, device) is named


def test_a_recipe_pin_that_names_another_nic_fails_on_that_node_only() -> None:

    spark1 = RankPins("10.0.0.1", "enp1s0f0np0", "rocep1s0f0", 3)
    spark3 = RankPins("10.0.0.3", "enP2p1s0f1np1", "roceP2p1s0f1", 3)
    env = (("NCCL_IB_GID_INDEX", "3"), ("NCCL_IB_HCA", "rocep1s0f0"))
    ok = rule_pin_env("spark1", spark1, env, "/r.toml")
    assert ok is not None and ok.status == OK
    bad = rule_pin_env("spark3", spark3, env, "/r.toml")
    assert bad is not None and bad.status == FAIL and "NCCL_IB_HCA=rocep1s0f0 (this node's is roceP2p1s0f1)" in bad.reason
    assert "GID_INDEX" not in bad.reason and "remove NCCL_IB_HCA from [container.env] in /r.toml" in bad.fix
    gid = rule_pin_env("spark3", replace(spark3, gid_index=5), (("NCCL_IB_GID_INDEX", "3"),), "/r.toml")
    assert gid is not None and gid.status == FAIL and "(this node's is 5)" in gid.reason
    assert rule_pin_env("spark3", spark3, (), "/r.toml") is None  # the recipe pins nothing: nothing to say


def test_memory_names_another_clusters_engine_and_waits_for_an_ended_one() -> None:
    """Another sparkctl cluster's engine is named as such and fails (up refuses next to it); a process
    that has ended but is still listed is memory on its way back: a warning that up waits for it."""
    theirs = _mem_facts(f"446, python3, 10758\n@@cgroup 446 {OTHER_CID}\n"
                        f"@@container {OTHER_CID}\t/sparkctl-prod-rank0\tprod\n")
    f = C.rule_memory("spark2", theirs, _needing(GB), needs())
    fails_with_fix(f, "spark2", "container sparkctl-prod-rank0 of sparkctl cluster 'prod'")
    assert "CLUSTER_NAME=prod" in f.fix
    ended = _mem_facts("77, VLLM::Worker_TP, 60000\n@@ended 77\n")
    m = ended.meminfo
    assert m is not None and m.free_bytes is not None and m.cache_bytes is not None
    w = C.rule_memory("spark2", ended, _needing(m.free_bytes + m.cache_bytes + GB), needs())
    assert w.status == WARN and "up waits for it to come back (MEMORY_WAIT_S)" in w.text, w
    assert "not yet given back: pid 77 VLLM::Worker_TP (62.9 GB; it has exited)" in w.text


def test_a_full_disks_fix_names_no_command_that_removes_what_is_not_sparkctls() -> None:
    """The fix for a full Docker disk never suggests a node-wide prune (`docker system prune` removes every
    stopped container, unused network and image on the node, other clusters' and other users' too)."""
    facts = healthy()
    facts.disks = [F.DiskUsage("b", 100 * GB, 0, 5 * GB, "/var/lib/docker")]
    f = C.rule_disk("n", facts)
    assert f.status == FAIL and "BUILD_KEEP_CHAINS" in f.fix, f.fix
    assert "prune" not in f.fix and "$(" not in f.fix, f.fix  # nothing in bulk: images by name only
