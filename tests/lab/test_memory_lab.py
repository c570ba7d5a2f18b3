"""Memory truth on the lab: on unified-memory nodes, for real where this machine can show it.

The lab hosts share this machine's kernel, so their /proc/meminfo, page cache and drop_caches are
real: a large file read fills the cache, `check` warns, `up` drops it. What the machine cannot show
goes through the nvidia-smi seam (lab/seams.set_gpu_seam): a foreign process holding GPU memory
(a real container's real pid, listed as a compute app) and a killed engine's memory that comes back
only seconds later (the dead engine still listed for `delay_s`). Each test restores the seam and
leaves no container of its cluster behind.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkctl.lab.seams import set_gpu_seam
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
CLUSTER = {"CLUSTER_NAME": "memtest", "PORT": "18951", "MASTER_PORT": "39551", "DROP_CACHES": "0"}
GHOST_PID = 4194303  # above this machine's pid_max: no process has it, so the probe says it has ended
FOREIGN = "memtest-trainer"


def sk(lab: Lab, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full = {**lab.env(), "NODES": " ".join(NODES), **CLUSTER, **(env or {})}
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=full, capture_output=True, text=True,
                          timeout=timeout)


def ours(lab: Lab) -> dict[str, list[str]]:
    return {n: lab.docker(n, "ps", "-a", "--filter", "label=sparkctl.cluster=memtest", "--format",
                          "{{.Names}} {{.State}}").stdout.split("\n")[:-1] for n in NODES}


def audit_actions(lab: Lab) -> list[tuple[str, str, str]]:
    r = sk(lab, "--json", "audit")
    return [(e["node"], e["action"], e.get("detail", "")) for e in json.loads(r.stdout)["entries"]]


@pytest.fixture
def clean(chain: Lab) -> Iterator[Lab]:
    lab = chain
    sk(lab, "down", timeout=120)
    try:
        yield lab
    finally:
        for n in NODES:
            set_gpu_seam(lab.host(n).bin_dir)
        lab.docker("spark2", "rm", "-f", FOREIGN)
        sk(lab, "lock", "--force-unlock", timeout=30)
        sk(lab, "down", timeout=120)
        assert ours(lab) == {n: [] for n in NODES}


def meminfo_kb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0])
    return out


def memory_rows(doc: dict) -> dict[str, dict]:
    return {f["node"]: f for f in doc["findings"] if f["check"] == "memory"}


def test_a_real_page_cache_is_a_warning_and_up_drops_it(clean: Lab, tmp_path: Path) -> None:
    """A real file read leaves MemFree below the plan's need (the page cache holds the rest): check
    warns on every node, naming the cache; up with DROP_CACHES=auto (GB10: on) drops it on every rank
    node, says how many GB it freed, audits it, and starts."""
    lab = clean
    plan = json.loads(sk(lab, "--json", "plan").stdout)["plan"]
    need_kb = plan["per_rank_total"] // 1024
    big = Path("/var/tmp/sparkctl-memtest.cache")
    try:
        for _ in range(40):  # bounded: at most 40 reads of 1 GiB
            m = meminfo_kb()
            if m["MemFree"] < need_kb - 1024 * 1024:
                break
            if not big.exists() or big.stat().st_size < 24 * 2**30:
                with big.open("ab") as f:
                    f.truncate(big.stat().st_size + 2**30 if big.exists() else 2**30)
            subprocess.run(["cat", str(big)], stdout=subprocess.DEVNULL, check=True, timeout=300)
        m = meminfo_kb()
        if m["MemFree"] >= need_kb:
            pytest.skip(f"could not fill the page cache past the plan's need here (MemFree {m['MemFree']} kB)")
        rc, doc = (lambda r: (r.returncode, json.loads(r.stdout)))(sk(lab, "--json", "check", "--out",
                                                                      str(tmp_path / "env.tp4")))
        rows = memory_rows(doc)
        for n in NODES:
            assert rows[n]["status"] == "warn", rows[n]
            assert "page cache" in rows[n]["reason"] and "DROP_CACHES" in rows[n]["fix"], rows[n]
        up = sk(lab, "up", env={"DROP_CACHES": "auto"})
        out = up.stdout + up.stderr
        assert up.returncode == 0, out
        freed = {n: float(g) for n, g in re.findall(r"dropped the page cache on (\w+) \(root\): ([\d.]+) GB freed", out)}
        assert set(freed) == set(NODES), out
        assert sum(freed.values()) >= 1.0, out
        dropped = {n for n, a, _ in audit_actions(lab) if a == "drop-caches"}
        assert dropped == set(NODES)
    finally:
        big.unlink(missing_ok=True)


def test_a_foreign_container_holding_gpu_memory_fails_check_and_up_refuses(clean: Lab, tmp_path: Path) -> None:
    """A container of no sparkctl cluster holds GPU memory on spark2 (its real pid, listed by the seam):
    check fails spark2's memory row naming the container; up refuses (exit 1) naming it, before
    anything starts; the container is left running (sparkctl does not stop what it did not start)."""
    lab = clean
    r = lab.docker("spark2", "run", "-d", "--name", FOREIGN, "--entrypoint", "sleep", "sparkctl-lab/engine:latest",
                   "600")
    assert r.returncode == 0, r.stderr
    pid = int(lab.docker("spark2", "inspect", "-f", "{{.State.Pid}}", FOREIGN).stdout)
    set_gpu_seam(lab.host("spark2").bin_dir, compute_apps=[{"pid": pid, "process_name": "python3",
                                                           "used_memory": 10758}])
    chk = sk(lab, "--json", "check", "--out", str(tmp_path / "env.tp4"))
    row = memory_rows(json.loads(chk.stdout))["spark2"]
    assert chk.returncode == 1 and row["status"] == "fail", row
    assert f"pid {pid} python3 (11.3 GB, container {FOREIGN})" in row["reason"], row
    assert f"docker stop {FOREIGN}" in row["fix"]
    up = sk(lab, "up")
    assert up.returncode == 1, up.stdout + up.stderr
    assert f"container {FOREIGN}" in up.stderr and "nothing was changed" in up.stderr, up.stderr
    assert ours(lab) == {n: [] for n in NODES}
    assert lab.docker("spark2", "inspect", "-f", "{{.State.Running}}", FOREIGN).stdout.strip() == "true"


def _ghost(lab: Lab, delay_s: float) -> None:
    set_gpu_seam(lab.host("spark2").bin_dir, release={
        "cluster": "memtest", "delay_s": delay_s, "pid": GHOST_PID, "process_name": "VLLM::Worker_TP",
        "used_memory": 60000})


def test_memory_not_yet_back_after_a_kill_up_waits_then_starts(clean: Lab) -> None:
    """spark2's killed engine is still listed for 8 s after its container stopped: `up --recreate`
    says what it waits for, waits, then starts every rank; the wait is audited."""
    lab = clean
    first = sk(lab, "up")
    assert first.returncode == 0, first.stdout + first.stderr
    _ghost(lab, 8)
    t = time.monotonic()
    up = sk(lab, "up", "--recreate")
    took = time.monotonic() - t
    out = up.stdout + up.stderr
    assert up.returncode == 0, out
    assert (f"for the memory on spark2 to come back: ended process(es) still hold GPU memory: pid {GHOST_PID} "
            "VLLM::Worker_TP (62.9 GB; it has exited)") in out, out
    back = re.search(r"memory back on spark2 after ([\d.]+) s", out)
    assert back and float(back.group(1)) >= 4, out
    assert took >= 8, out
    assert "dropped the page cache" not in out  # DROP_CACHES=0: never dropped
    assert all(len(v) == 1 and v[0].endswith("running") for v in ours(lab).values()), ours(lab)
    assert any(n == "spark2" and a == "memory-wait" for n, a, _ in audit_actions(lab))


def test_memory_never_back_refuses_with_the_numbers_and_starts_nothing(clean: Lab) -> None:
    """The killed engine's memory never comes back: after MEMORY_WAIT_S up refuses (exit 1) with the
    numbers, and nothing of the new release runs anywhere."""
    lab = clean
    first = sk(lab, "up")
    assert first.returncode == 0, first.stdout + first.stderr
    _ghost(lab, 10**6)
    up = sk(lab, "up", "--recreate", env={"MEMORY_WAIT_S": "6"})
    out = up.stdout + up.stderr
    assert up.returncode == 1, out
    assert "the memory did not come back within 6 s (MEMORY_WAIT_S)" in up.stderr, out
    assert f"spark2: ended process(es) still hold GPU memory: pid {GHOST_PID} VLLM::Worker_TP (62.9 GB" in up.stderr
    assert ours(lab) == {n: [] for n in NODES}
    assert any(n == "spark2" and a == "memory-wait-refused" for n, a, _ in audit_actions(lab))
