"""The lab is a real cluster: SSH, separate engines, fabric, per-host model folders, seams, a service."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

# The header real nvidia-smi printed for this query (captures/nvidia-smi-h200/query.csv).
CAPTURED_FIELDS = "name,driver_version,memory.total,memory.used,memory.free,uuid,pci.bus_id,compute_cap,count"
CAPTURED_HEADER = ("name, driver_version, memory.total [MiB], memory.used [MiB], memory.free [MiB], uuid, "
                   "pci.bus_id, compute_cap, count")


def http(url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""  # refused / reset: nothing listening


def wait_health(url: str, want: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http(url, timeout=2)[0] == want:
            return True
        time.sleep(0.3)
    return False


# --------------------------------------------------------------------------------------------- SSH
def test_ssh_by_alias_with_host_key_checking(lab: Lab) -> None:
    for name in lab.names:
        res = subprocess.run(["ssh", "-F", str(lab.ssh_config), name, "true"], capture_output=True, timeout=30)
        assert res.returncode == 0, f"{name}: {res.stderr.decode()}"
        assert lab.ssh(name, "hostname").stdout.strip() == name
    # every connection is logged (benchmarks count these lines)
    assert "Accepted publickey for root" in lab.host("spark1").sshd_log.read_text()


def test_wrong_known_hosts_is_refused(lab: Lab, tmp_path) -> None:
    # spark1's alias with spark2's key: ssh must refuse, not ask and not continue
    spark2_key = lab.known_hosts.read_text().splitlines()[1].split(None, 1)[1]
    h1 = lab.host("spark1")
    bad = tmp_path / "known_hosts"
    bad.write_text(f"spark1,{h1.mgmt_ip} {spark2_key}\n")
    res = subprocess.run(["ssh", "-F", str(lab.ssh_config), "-o", f"UserKnownHostsFile={bad}", "spark1", "true"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 255
    assert "HOST IDENTIFICATION HAS CHANGED" in res.stderr or "Host key verification failed" in res.stderr


def test_session_environment_has_the_seams(lab: Lab) -> None:
    for h in lab.hosts:
        out = lab.ssh(h.name, "sh", "-c", 'echo "$PATH|$DOCKER_HOST|$SPARKCTL_SYSFS_ROOT"; command -v nvidia-smi')
        path, docker_host, sysfs = out.stdout.splitlines()[0].split("|")
        assert path.split(":")[0] == str(h.bin_dir)
        assert docker_host == h.docker_host
        assert sysfs == str(h.sysfs_root)
        assert out.stdout.splitlines()[1] == f"{h.bin_dir}/nvidia-smi"


# --------------------------------------------------------------------------------------------- Docker
def test_each_host_has_its_own_engine(lab: Lab) -> None:
    roots = {h.name: lab.ssh(h.name, "docker", "info", "--format", "{{.DockerRootDir}}").stdout.strip()
             for h in lab.hosts}
    assert len(set(roots.values())) == len(lab.hosts)
    assert roots["spark1"] == str(lab.host("spark1").docker_root)
    try:
        run = lab.ssh("spark1", "docker", "run", "-d", "--name", "lab-probe", "sparkctl-lab/base:bookworm", "sleep", "60")
        assert run.returncode == 0, run.stderr
        assert "lab-probe" in lab.ssh("spark1", "docker", "ps", "--format", "{{.Names}}").stdout
        for other in lab.names[1:]:
            assert "lab-probe" not in lab.ssh(other, "docker", "ps", "-a", "--format", "{{.Names}}").stdout
    finally:
        lab.rm([("spark1", "lab-probe")])


def test_images_are_loaded_everywhere(lab: Lab) -> None:
    for name in lab.names:
        res = lab.docker(name, "image", "inspect", "--format", "{{.Size}}", "sparkctl-lab/base:bookworm")
        assert res.returncode == 0 and int(res.stdout) >= 100 * 10**6
        res = lab.docker(name, "run", "--rm", "--entrypoint", "vllm", "sparkctl-lab/engine:latest", "--version")
        assert res.returncode == 0 and res.stdout.strip()


# --------------------------------------------------------------------------------------------- network
def test_hosts_reach_each_other_on_fabric_addresses(lab: Lab) -> None:
    probe = ("import socket,sys\n"
             "for ip in sys.argv[1:]:\n"
             "    socket.create_connection((ip, 22), timeout=3).close()\n")
    targets = [h.fabric_ip for h in lab.hosts]
    for h in lab.hosts:
        addrs = json.loads(lab.ssh(h.name, "ip", "-j", "-4", "addr", "show", "dev", h.fabric_if).stdout)
        assert addrs[0]["addr_info"][0]["local"] == h.fabric_ip
        idle = json.loads(lab.ssh(h.name, "ip", "-j", "-4", "addr", "show", "dev", h.idle_if).stdout)
        assert not any(link.get("addr_info") for link in idle), f"{h.name}: {h.idle_if} has an IPv4"
        res = lab.ssh(h.name, "python3", "-c", probe, *targets)
        assert res.returncode == 0, f"{h.name}: {res.stderr}"
    assert lab.host("spark3").fabric_if == "enp1s0f1np1"  # the second-port host


# --------------------------------------------------------------------------------------------- model folder
def test_model_folder_is_per_host(lab: Lab) -> None:
    marker = lab.host("spark2").model_dir / "ONLY-ON-SPARK2"
    try:
        marker.write_text("nfs mistake\n")
        assert lab.ssh("spark2", "cat", "/models/lab/ONLY-ON-SPARK2").stdout == "nfs mistake\n"
        res = lab.docker("spark2", "run", "--rm", "-v", "/models/lab:/models/lab:ro", "sparkctl-lab/base:bookworm",
                         "cat", "/models/lab/ONLY-ON-SPARK2")
        assert res.stdout == "nfs mistake\n"
        for other in ("spark1", "spark3"):
            assert lab.ssh(other, "test", "-e", "/models/lab/ONLY-ON-SPARK2").returncode == 1
            assert lab.ssh(other, "test", "-f", "/models/lab/config.json").returncode == 0
    finally:
        marker.unlink(missing_ok=True)


def test_shared_memory_is_per_host_as_on_separate_machines(lab: Lab) -> None:
    """Each host has its own /dev/shm (and IPC namespace), also inside a container run with `--ipc host`:
    vLLM tells a rank on its own node from one on another by opening a shared-memory segment, and with one
    /dev/shm for every lab host two real ranks on spark1 and spark2 stalled after their first Gloo group."""
    name = "sparkctl-lab-shm-probe"
    try:
        assert lab.ssh("spark1", "sh", "-c", f"echo here > /dev/shm/{name}").returncode == 0
        seen = lab.docker("spark1", "run", "--rm", "--ipc", "host", "sparkctl-lab/base:bookworm",
                          "cat", f"/dev/shm/{name}")
        assert seen.stdout == "here\n", seen.stderr  # the host's own /dev/shm is what --ipc host shares
        for other in ("spark2", "spark3"):
            assert lab.ssh(other, "test", "-e", f"/dev/shm/{name}").returncode == 1, other
            res = lab.docker(other, "run", "--rm", "--ipc", "host", "sparkctl-lab/base:bookworm",
                             "test", "-e", f"/dev/shm/{name}")
            assert res.returncode == 1, (other, res.stderr)
    finally:
        lab.ssh("spark1", "rm", "-f", f"/dev/shm/{name}")


# --------------------------------------------------------------------------------------------- seams
def test_nvidia_smi_answers_like_a_gb10(lab: Lab) -> None:
    res = lab.ssh("spark1", "nvidia-smi", f"--query-gpu={CAPTURED_FIELDS}", "--format=csv")
    header, row = res.stdout.splitlines()
    assert header == CAPTURED_HEADER
    values = row.split(", ")
    assert values[:5] == ["NVIDIA GB10", values[1], "[N/A]", "[N/A]", "[N/A]"]
    assert values[1].startswith("580.") and values[5].startswith("GPU-") and values[7:] == ["12.1", "1"]
    res = lab.ssh("spark1", "nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits")
    assert res.stdout == "NVIDIA GB10, 12.1, [N/A]\n"
    res = lab.ssh("spark1", "nvidia-smi", "--query-gpu=name,bogus.field", "--format=csv")
    assert res.returncode == 2 and 'Field "bogus.field" is not a valid field to query.' in res.stdout
    assert lab.ssh("spark1", "nvidia-smi", "-L").stdout.startswith("GPU 0: NVIDIA GB10 (UUID: GPU-")
    assert "NVIDIA GB10" in lab.ssh("spark2", "nvidia-smi").stdout


def test_sysfs_seam_has_roce_v2_gids(lab: Lab) -> None:
    for h in lab.hosts:
        port = f"$SPARKCTL_SYSFS_ROOT/{h.fabric_hca}/ports/1"
        res = lab.ssh(h.name, "sh", "-c", f"cat {port}/gid_attrs/types/{h.gid_index} {port}/gids/{h.gid_index} "
                      f"{port}/gid_attrs/ndevs/{h.gid_index} {port}/state; ls $SPARKCTL_SYSFS_ROOT/{h.fabric_hca}/device/net")
        gtype, gid, ndev, state, netdev = res.stdout.splitlines()
        octets = [int(x) for x in h.fabric_ip.split(".")]
        assert gtype == "RoCE v2" and ndev == h.fabric_if == netdev and state == "4: ACTIVE"
        assert gid.endswith(f"ffff:{octets[0]:02x}{octets[1]:02x}:{octets[2]:02x}{octets[3]:02x}")
    assert lab.host("spark2").gid_index == 5 and lab.host("spark1").gid_index == 3


# --------------------------------------------------------------------------------------------- the service
def _vllm_args(lab: Lab, rank: int, head_ip: str, nnodes: int = 4) -> list[str]:
    args = ["--served-model-name", "lab", "--tensor-parallel-size", "4", "--decode-context-parallel-size", "4",
            "--dcp-comm-backend", "ag_rs", "--nnodes", str(nnodes), "--node-rank", str(rank),
            "--master-addr", head_ip, "--master-port", "29511", "--kv-cache-dtype", "fp8",
            "--kv-cache-memory-bytes", "1073741824", "--max-model-len", "8192",
            "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}']
    return args + (["--headless"] if rank else ["--port", "8899"])


def test_four_rank_service_answers_and_fails_as_vllm_when_a_rank_dies(lab: Lab) -> None:
    names = lab.names[:4]
    head = lab.host(names[0])
    containers = [(name, f"lab-rank{rank}") for rank, name in enumerate(names)]
    url = f"http://{head.mgmt_ip}:8899"
    try:
        for rank, name in reversed(list(enumerate(names))):  # workers first, then the head
            lab.run_rank(name, f"lab-rank{rank}", _vllm_args(lab, rank, head.fabric_ip),
                         env={**lab.rank_env(name), "STANDIN_RENDEZVOUS_TIMEOUT_S": "60"})
        assert wait_health(f"{url}/health", 200, 60), lab.logs(names[0], "lab-rank0")
        status, body = http(f"{url}/v1/chat/completions",
                            {"model": "lab", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
        assert status == 200, body
        reply = json.loads(body)
        assert reply["usage"]["completion_tokens"] == 8 and reply["choices"][0]["message"]["content"]
        head_log = lab.logs(names[0], "lab-rank0")
        assert "[4/4]" in head_log and "Application startup complete." in head_log
        assert f"joined from {lab.host('spark3').fabric_ip} (enp1s0f1np1)" in head_log
        # kill one worker: as the real engine (docs/sources.md, "Real vLLM on CPU"), the head stays healthy until
        # the next request, which fails 500 EngineDeadError; then the head exits 0 and the other workers stay up
        lab.docker(names[2], "kill", "lab-rank2")
        time.sleep(4)  # past the stand-in's heartbeat timeout: it knows, and says nothing
        assert http(f"{url}/health", timeout=2)[0] == 200
        status, body = http(f"{url}/v1/chat/completions",
                            {"model": "lab", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
        assert status == 500 and b"EngineCore encountered an issue" in body, (status, body)
        code = lab.wait_exit(names[0], "lab-rank0", 20)
        assert code == 0, f"the head on {names[0]} did not exit 0, as vLLM's does: {code}"
        assert http(f"{url}/health", timeout=2)[0] == 0
        for rank in (1, 3):  # orphans: only a supervisor removes them
            assert lab.wait_exit(names[rank], f"lab-rank{rank}", 1) is None, f"rank {rank} exited"
    finally:
        lab.rm(containers)


def test_wrong_interface_pin_fails_the_rendezvous(lab: Lab) -> None:
    head = lab.host("spark1")
    pairs = [("spark3", "lab-badpin-noaddr"), ("spark2", "lab-badpin-missing")]
    try:
        # spark3's first port is up but has no IPv4 (its address is on the second port)
        lab.run_rank("spark3", pairs[0][1], _vllm_args(lab, 2, head.fabric_ip),
                     env=lab.rank_env("spark3", ifname="enp1s0f0np0"))
        lab.run_rank("spark2", pairs[1][1], _vllm_args(lab, 1, head.fabric_ip),
                     env=lab.rank_env("spark2", ifname="enp9s0f0np0"))
        for name, container in pairs:
            assert lab.wait_exit(name, container, 15) not in (None, 0)
            assert "Unable to find address for" in lab.logs(name, container)
    finally:
        lab.rm(pairs)


def test_missing_shard_kills_the_rank(lab: Lab) -> None:
    h = lab.host("spark4")
    index = json.loads((h.model_dir / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    hidden = h.model_dir / f".{shard}.hidden"
    (h.model_dir / shard).rename(hidden)
    try:
        lab.run_rank("spark4", "lab-noshard", ["--served-model-name", "lab", "--port", "8898"])
        assert lab.wait_exit("spark4", "lab-noshard", 15) not in (None, 0)
        assert shard in lab.logs("spark4", "lab-noshard")
    finally:
        hidden.rename(h.model_dir / shard)
        lab.rm([("spark4", "lab-noshard")])


# --------------------------------------------------------------------------------------------- the command
def test_lab_up_reuses_a_healthy_lab_and_status_reports_it(lab: Lab) -> None:
    sparkctl = [sys.executable, "-m", "sparkctl"]
    t0 = time.monotonic()
    res = subprocess.run([*sparkctl, "lab", "up", "--nodes", str(len(lab.hosts))], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 30
    assert res.stdout.splitlines() == [f"SPARKCTL_SSH_CONFIG={lab.ssh_config}", f"SPARKCTL_ENV_FILE={lab.env_file}"]
    res = subprocess.run([*sparkctl, "lab", "status"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and f"SPARKCTL_ENV_FILE={lab.env_file}" in res.stdout
    doc = json.loads(subprocess.run([*sparkctl, "--json", "lab", "status"], capture_output=True, text=True,
                                    timeout=120).stdout)
    assert doc["ok"] and [h["name"] for h in doc["hosts"]] == lab.names
    env = dict(line.split("=", 1) for line in lab.env_file.read_text().splitlines() if "=" in line and line[0] != "#")
    assert env["NODES"].strip('"').split() == lab.names and env["MODEL"] == "/models/lab" and env["RECIPE"] == "lab"


def _cli(lab: Lab, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env={**lab.env(), **(env or {})},
                          capture_output=True, text=True, timeout=900)


def _ipv4(name: str, port: str) -> list[str]:
    got = json.loads(subprocess.run(["ip", "-n", name, "-j", "-4", "addr", "show", "dev", port], capture_output=True,
                                    text=True, timeout=10, check=True).stdout)
    return [a["local"] for link in got for a in link.get("addr_info", [])]


def test_lab_up_fresh_then_setup_then_lab_up_puts_the_lab_back(lab: Lab) -> None:
    """`lab up --fresh`: no fabric port has an address, every host is healthy (its fabric is setup's to make),
    and setup plans the netplan file on every host and applies it; `lab up` after: each host back on the lab's
    own fabric address, and nothing setup wrote left in its root."""
    from sparkctl.lab.state import PORT_IFS, HostPaths

    names = [h.name for h in lab.hosts]
    env = {"NODES": " ".join(names[:4]), "CLUSTER_NAME": "freshlab"}
    try:
        r = _cli(lab, "lab", "up", "--nodes", str(len(names)), "--fresh")
        assert r.returncode == 0, r.stdout + r.stderr
        assert all(_ipv4(n, p) == [] for n in names for p in PORT_IFS)
        assert _cli(lab, "lab", "status").returncode == 0
        plan = json.loads(_cli(lab, "--json", "setup", env=env).stdout)
        assert plan["cabling"]["layout"] == "switch", plan["cabling"]
        assert {c["node"] for c in plan["changes"] if c.get("path") == "/etc/netplan/60-sparkctl-fabric.yaml"} == set(names[:4])
        r = _cli(lab, "setup", "--yes", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert all(_ipv4(n, lab.host(n).fabric_if) for n in names[:4])  # setup's addresses
        assert _cli(lab, "lab", "status").returncode == 0
    finally:
        r = _cli(lab, "lab", "up", "--nodes", str(len(names)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _cli(lab, "lab", "status").returncode == 0
    for h in lab.hosts:
        assert _ipv4(h.name, h.fabric_if) == [h.fabric_ip], h.name
        etc = HostPaths.of(h.name, lab.root).setup_root / "etc"
        assert sorted(p.name for p in etc.iterdir()) == ["machine-id"], h.name
