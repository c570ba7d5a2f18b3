"""`sparkctl diagnose` and check's parity row on the lab: each seam (another kernel string with CMA=0,
another CX7 firmware, a fabric port at an odd MTU, a kernel OOM line in a host's ring buffer, an image with
/etc/nccl.conf) appears in `check` and in the bundle; planted secrets never reach the bundle of a real
service; a host whose sshd is down is named in the manifest, its files missing with why.

Needs a lab whose hosts carry $SPARKCTL_KERNEL_SEAM (sshd's SetEnv: a lab brought up by this version) and
whose sysfs trees have fw_ver (lab.seams.write_sysfs)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkctl.lab import hosts as labhosts
from sparkctl.lab import seams
from sparkctl.lab.state import HostPaths
from tests.kit.lab import Lab
from tests.lab.faults import docker_frozen, sshd_stopped
from tests.lab.test_secrets_lab import SECRETS, leaks, secret_env  # noqa: F401 - the fixture

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
OOM = "[Fri Dec  4 03:01:02 2026] Out of memory: Killed process 4242 (python3) total-vm:120000000kB, anon-rss:1kB"
BAD_KERNEL = "7.0.0-1019-nvidia"
OLD_FW = "28.39.1002"


def sparkctl(env: dict[str, str], cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def bundle(env: dict[str, str], cwd: Path, *extra: str) -> tuple[dict[str, object], dict[str, str]]:
    out = cwd / "bundle.tar.gz"
    r = sparkctl(env, cwd, "--json", "diagnose", "--out", str(out), *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(out) as tar:
        files = {m.name.removeprefix("sparkctl-diagnose/"): tar.extractfile(m).read().decode("utf-8", "replace")  # type: ignore[union-attr]
                 for m in tar.getmembers() if m.isfile()}
    return json.loads(r.stdout), files


def parity(doc: dict[str, object], node: str) -> dict[str, str]:
    return next(f for f in doc["findings"] if f["node"] == node and f["check"] == "parity")  # type: ignore[index, union-attr, attr-defined]


ODD_MTU: list[int] = [1500]


def odd_mtu(current: int) -> int:
    """An MTU the lab's fabric ports do not have (9000 where they run 1500, else 1500): spark4's odd one."""
    ODD_MTU[0] = 9000 if current == 1500 else 1500
    return ODD_MTU[0]


@pytest.fixture
def seamed(chain: Lab) -> Iterator[Lab]:
    """spark2: kernel 7.0.0-1019 with cma=0; spark3: older CX7 firmware; spark4: its fabric port at an MTU the others do not have;
    spark1: an OOM killer line in its ring buffer. Undone after."""
    lab = chain
    p = {n: HostPaths.of(n, lab.root) for n in NODES}
    spark4 = lab.host("spark4")
    mtu = json.loads(subprocess.run(["nsenter", f"--net={p['spark4'].netns}", "ip", "-j", "link", "show", "dev",
                                     spark4.fabric_if], capture_output=True, text=True, check=True).stdout)[0]["mtu"]
    try:
        seams.set_kernel_seam(p["spark2"].kernel_seam, release=BAD_KERNEL, cmdline="ro quiet cma=0")
        seams.set_firmware(lab.host("spark3").sysfs_root, OLD_FW)
        labhosts.set_port_mtu(p["spark4"], spark4.fabric_if, odd_mtu(mtu))
        seams.set_kernel_seam(p["spark1"].kernel_seam, kmsg=["usb 1-1: new device", OOM])
        yield lab
    finally:
        seams.set_kernel_seam(p["spark2"].kernel_seam)
        seams.set_kernel_seam(p["spark1"].kernel_seam)
        seams.set_firmware(lab.host("spark3").sysfs_root)
        labhosts.set_port_mtu(p["spark4"], spark4.fabric_if, mtu)


def test_each_seam_appears_in_check_and_in_the_bundle(seamed: Lab, tmp_path: Path) -> None:
    env = {**seamed.env(), "NODES": " ".join(NODES), **seamed.pin_knobs(NODES)}
    r = sparkctl(env, tmp_path, "--json", "check")
    doc = json.loads(r.stdout)
    s2, s3, s4, s1 = (parity(doc, n) for n in ("spark2", "spark3", "spark4", "spark1"))
    assert s2["status"] == "fail" and "ibv_reg_mr" in s2["reason"] and f"kernel {BAD_KERNEL}" in s2["reason"], s2
    assert s3["status"] == "warn" and f"CX7 firmware {OLD_FW}, the others have {seams.LAB_FW}" in s3["reason"], s3
    # spark4's one up fabric port at the odd MTU (a host's ports that agree are named by their MTU alone)
    assert s4["status"] == "fail" and f"fabric MTU {ODD_MTU[0]}," in s4["reason"] and "the others have" in s4["reason"], s4
    assert s1["status"] == "ok", s1
    manifest, files = bundle(env, tmp_path)
    assert BAD_KERNEL in files["nodes/spark2/kernel.txt"] and "cma=0" in files["nodes/spark2/kernel.txt"]
    assert f"fw {OLD_FW}" in files["nodes/spark3/fabric.txt"]
    assert f"mtu {ODD_MTU[0]}" in files["nodes/spark4/fabric.txt"]
    assert OOM in files["nodes/spark1/kernel-lines.txt"]
    assert any(f["node"] == "spark2" and f["check"] == "parity" and f["status"] == "fail"
               for f in json.loads(files["check.json"])["findings"])
    assert manifest["unreachable"] == {}


@pytest.fixture
def nccl_conf_image(chain: Lab) -> Iterator[tuple[Lab, str]]:
    """The lab recipe's image with /etc/nccl.conf added, on every host, labelled by the version probe `build`
    runs (image.chain.versions_argv, label_versions_argv)."""
    from sparkctl.image import chain as im

    lab = chain
    tag = "sparkctl-lab/ncclconf:test"
    conf = subprocess.run([sys.executable, "-m", "sparkctl", "--json", "config"],
                          env={**lab.env(), "NODES": " ".join(NODES)}, capture_output=True, text=True, timeout=60)
    base = json.loads(conf.stdout)["settings"]["IMAGE"]["value"]  # the recipe's image, as settings resolve it
    try:
        for n in NODES:
            r = subprocess.run(["docker", "-H", lab.host(n).docker_host, "build", "-q", "-t", tag, "-"],
                               input=f"FROM {base}\nRUN echo NCCL_IB_DISABLE=1 > /etc/nccl.conf\n",
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            v = lab.docker(n, *im.versions_argv(tag), timeout=300)
            versions = im.parse_versions(v.stdout)
            assert versions["nccl.conf"] == "present", versions
            argv = im.label_versions_argv(tag, versions)
            r = subprocess.run(["env", f"DOCKER_HOST={lab.host(n).docker_host}", *argv[1:]], input=f"FROM {tag}\n",
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
        yield lab, tag
    finally:
        for n in NODES:
            lab.docker(n, "rmi", "-f", tag)


def test_an_image_with_nccl_conf_fails_parity_and_shows_in_the_bundle(nccl_conf_image: tuple[Lab, str],
                                                                      tmp_path: Path) -> None:
    lab, tag = nccl_conf_image
    env = {**lab.env(), "NODES": " ".join(NODES), "IMAGE": tag, **lab.pin_knobs(NODES)}
    doc = json.loads(sparkctl(env, tmp_path, "--json", "check").stdout)
    for n in NODES:
        f = parity(doc, n)
        assert f["status"] == "fail" and "/etc/nccl.conf" in f["reason"], f
    _, files = bundle(env, tmp_path, "--no-check")
    assert '\\"nccl.conf\\":\\"present\\"' in files["nodes/spark1/image-inspect.json"]


def test_planted_secrets_never_reach_the_bundle_of_a_real_service(secret_env: tuple[Lab, Path, dict[str, str]]) -> None:  # noqa: F811
    lab, cwd, env = secret_env
    assert sparkctl(env, cwd, "up").returncode == 0
    assert sparkctl(env, cwd, "wait", "--timeout", "120").returncode == 0
    container = f"sparkctl-{env['CLUSTER_NAME']}-rank1"
    # a log line (the engine's stdout) and an audit line that carry secrets
    lab.docker("spark2", "exec", container, "sh", "-c",
               f"echo 'loading with token {SECRETS['HF_TOKEN']} key={SECRETS['VLLM_API_KEY']}' > /proc/1/fd/1")
    planted = f'{{"action":"note","detail":"password={SECRETS["STANDIN_DB_PASSWORD"]}"}}'
    audit = HostPaths.of("spark3", lab.root).home / ".sparkctl" / env["CLUSTER_NAME"] / "audit.log"
    lab.ssh("spark3", "sh", "-c", f"echo '{planted}' >> ~/.sparkctl/{env['CLUSTER_NAME']}/audit.log")
    try:
        manifest, files = bundle(env, cwd)
    finally:  # the planted line leaves the audit: later tests of this cluster read it
        audit.write_text("".join(ln for ln in audit.read_text().splitlines(keepends=True) if planted not in ln))
    assert leaks("\n".join(files.values())) == []
    assert "HF_TOKEN=[REDACTED]" in files["nodes/spark2/docker-inspect.json"]  # the container env was there
    assert "token [REDACTED]" in files[f"nodes/spark2/logs/{container}.log"]
    assert "password=[REDACTED]" in files["nodes/spark3/audit.jsonl"]
    assert "HF_TOKEN=[REDACTED]" in "".join(v for k, v in files.items() if k.startswith("local/"))
    assert not any(f.get("missing") for f in manifest["files"] if f["path"] in ("status.json", "check.json"))


def test_diagnose_with_a_node_down_names_it(chain: Lab, tmp_path: Path) -> None:
    env = {**chain.env(), "NODES": " ".join(NODES), **chain.pin_knobs(NODES)}
    with sshd_stopped(chain, "spark3"):
        manifest, files = bundle(env, tmp_path)
    assert "spark3" in manifest["unreachable"]
    gone = [f for f in manifest["files"] if f["node"] == "spark3"]
    assert gone and all(f.get("missing") and f["why"] for f in gone)
    assert "nodes/spark2/kernel.txt" in files and "check.json" in files


def test_a_wedged_engine_costs_only_the_docker_files(chain: Lab, tmp_path: Path) -> None:
    """spark1's dockerd frozen: the probe's deadline passes in its docker sections; what it read before (the
    kernel, the fabric, the kernel's lines) is in the bundle, each docker file missing with the deadline as why."""
    env = {**chain.env(), "NODES": " ".join(NODES), **chain.pin_knobs(NODES)}
    with docker_frozen(chain, "spark1"):
        manifest, files = bundle(env, tmp_path, "--no-check", "--timeout", "3")
    assert manifest["unreachable"] == {}
    for kept in ("kernel.txt", "fabric.txt", "kernel-lines.txt"):
        assert f"nodes/spark1/{kept}" in files, kept
    why = {f["path"]: f.get("why", "") for f in manifest["files"] if f.get("missing")}
    assert why["nodes/spark1/docker-version.txt"].startswith("cut short:"), why
    assert "did not finish within 13s" in why["nodes/spark1/docker-inspect.json"], why
    assert "nodes/spark2/docker-version.txt" in files
