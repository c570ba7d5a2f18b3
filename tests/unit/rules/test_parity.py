"""check's parity row: a difference names the odd node and what the others have; the known-bad
combinations (CMA=0 kernel with RDMA, an image's CUDA newer than the driver, /etc/nccl.conf) fail."""

from __future__ import annotations

import ipaddress
import json

from sparkctl.facts import docker_parse as D
from sparkctl.facts import node_facts as F
from sparkctl.rules import parity as P
from sparkctl.rules.findings import FAIL, OK, WARN

NODES = ["a", "b", "c", "d"]
REF = "img:tp4"


def facts(kernel: str = "6.11.0-1016-nvidia", driver: str = "580.95.05", fw: str = "28.45.1020",
          mtu: int = 9000, docker: str = "28.3.3", cma: int | None = 64 * 1024 * 1024,
          cmdline: str = "ro quiet") -> F.NodeFacts:
    return F.NodeFacts(
        kernel=F.KernelInfo(kernel, cmdline),
        gpus=[F.Gpu(0, "NVIDIA GB10", driver, None, "12.1")],
        firmware={"rocep1s0f0": fw, "roceP2p1s0f0": fw},
        hcas=[F.Hca("rocep1s0f0", ("enp1s0f0np0",)), F.Hca("roceP2p1s0f0", ("enP2p1s0f0np0",))],
        netdevs=[F.NetDev("enp1s0f0np0", "UP", ("UP", "LOWER_UP"), (ipaddress.IPv4Interface("10.0.0.1/24"),),
                          mtu=mtu),
                 F.NetDev("enP2p1s0f0np0", "UP", ("UP", "LOWER_UP"), (), mtu=9000)],
        docker=D.DockerVersion("28.3.3", docker, "1.51", "linux", "arm64"),
        meminfo=F.MemInfo(128 << 30, 100 << 30, cma_total_bytes=cma),
    )


def image(versions: dict[str, str] | None = None, cuda_env: str | None = None) -> list[D.Image]:
    labels = {"sparkctl.versions": json.dumps(versions)} if versions else {}
    return [D.Image("sha256:" + "1" * 64, (REF,), labels, ("l1",), cuda_version=cuda_env)]


def run(by_node: dict[str, F.NodeFacts], images: dict[str, list[D.Image] | None] | None = None) -> dict[str, object]:
    found = P.rule_parity(list(by_node), by_node, images or {}, "a", REF)
    return {f.node: f for f in found}


def test_same_everywhere_is_ok() -> None:
    got = run({n: facts() for n in NODES})
    assert all(f.status == OK for f in got.values()), got  # type: ignore[attr-defined]


def test_odd_kernel_names_the_node_and_what_the_others_have() -> None:
    by = {n: facts() for n in NODES} | {"c": facts(kernel="6.8.0-60-generic")}
    got = run(by)
    c = got["c"]
    assert c.status == WARN  # type: ignore[attr-defined]
    assert "kernel 6.8.0-60-generic, the others have 6.11.0-1016-nvidia (a, b, d)" in c.reason  # type: ignore[attr-defined]
    assert all(got[n].status == OK for n in "abd")  # type: ignore[attr-defined]


def test_odd_firmware_and_docker_warn() -> None:
    by = {n: facts() for n in NODES} | {"b": facts(fw="28.39.1002", docker="27.5.1")}
    b = run(by)["b"]
    assert b.status == WARN and "CX7 firmware 28.39.1002" in b.reason and "Docker 27.5.1" in b.reason  # type: ignore[attr-defined]


def test_mtu_1500_on_one_fabric_port_fails() -> None:
    by = {n: facts() for n in NODES} | {"d": facts(mtu=1500)}
    d = run(by)["d"]
    assert d.status == FAIL and "fabric MTU 1500, the others have 9000" in d.reason and "(a, b, c)" in d.reason  # type: ignore[attr-defined]


def test_a_port_without_a_cable_keeps_its_mtu_out_of_the_comparison() -> None:
    """A node cabled on both ports (both at 9000) beside nodes whose second port is down at 1500: no difference
    that drops frames, so no failure; the down port's MTU is not compared."""
    def one_port_down() -> F.NodeFacts:
        f = facts()
        assert f.netdevs is not None
        f.netdevs[1] = F.NetDev("enP2p1s0f0np0", "DOWN", ("BROADCAST",), (), mtu=1500)
        return f

    def second_port_up_without_an_address() -> F.NodeFacts:  # a second cable to the switch setup left unaddressed
        f = facts()
        assert f.netdevs is not None
        f.netdevs[1] = F.NetDev("enP2p1s0f0np0", "UP", ("UP", "LOWER_UP"), (), mtu=1500)
        return f

    by = {"a": one_port_down(), "b": one_port_down(), "c": second_port_up_without_an_address(), "d": one_port_down()}
    got = run(by)
    assert all(f.status == OK for f in got.values()), got  # type: ignore[attr-defined]


def test_a_tie_takes_the_heads_value_as_the_reference() -> None:
    by = {"a": facts(), "b": facts(), "c": facts(driver="590.44.01"), "d": facts(driver="590.44.01")}
    got = run(by)
    assert got["a"].status == OK and got["c"].status == WARN  # type: ignore[attr-defined]


def test_cma0_kernel_with_rdma_fails_from_meminfo_or_cmdline() -> None:
    bad = P.BAD_KERNEL_PREFIX + "-nvidia"
    by = {n: facts(kernel=bad) for n in NODES} | {"b": facts(kernel=bad, cma=0)}
    by["c"] = facts(kernel=bad, cma=None, cmdline="ro cma=0 quiet")
    got = run(by)
    assert got["b"].status == FAIL and "ibv_reg_mr" in got["b"].reason and "CmaTotal is 0" in got["b"].reason  # type: ignore[attr-defined]
    assert got["c"].status == FAIL and "cma=0" in got["c"].reason  # type: ignore[attr-defined]
    assert got["a"].status == OK  # the same kernel with a CMA pool  # type: ignore[attr-defined]


def test_cma0_without_rdma_is_not_the_known_bad_combination() -> None:
    f = facts(kernel=P.BAD_KERNEL_PREFIX + "-nvidia", cma=0)
    f.hcas = []
    assert P.known_bad("a", f, None, None, REF) == []


def test_image_cuda_newer_than_the_driver_fails() -> None:
    by = {n: facts(driver="580.95.05") for n in NODES}
    got = run(by, {n: image({"cuda": "13.1", "nccl": "2.28.3"}) for n in NODES})
    assert all(f.status == FAIL and "needs driver ≥ 590.44.01" in f.reason for f in got.values())  # type: ignore[attr-defined]
    ok = run(by, {n: image({"cuda": "13.0"}) for n in NODES})
    assert all(f.status == OK for f in ok.values())  # type: ignore[attr-defined]
    from_env = run(by, {n: image(cuda_env="13.1.0") for n in NODES})
    assert all(f.status == FAIL for f in from_env.values())  # type: ignore[attr-defined]


def test_min_driver_table() -> None:
    assert P.min_driver_for_cuda("12.8.1") == "570.26"
    assert P.min_driver_for_cuda("13.0") == "580.65.06"
    assert P.min_driver_for_cuda("11.8") is None


def test_image_with_nccl_conf_fails() -> None:
    got = run({n: facts() for n in NODES}, {n: image({"nccl.conf": "present"}) for n in NODES})
    assert all(f.status == FAIL and "/etc/nccl.conf" in f.reason for f in got.values())  # type: ignore[attr-defined]


def test_image_env_cuda_version_is_the_only_env_read() -> None:
    text = json.dumps([{"Id": "sha256:" + "2" * 64, "RepoTags": [REF],
                        "Config": {"Env": ["HF_TOKEN=hf_secret", "CUDA_VERSION=13.0.1", "PATH=/bin"]}}])
    img = D.parse_image_inspect(text)[0]
    assert img.cuda_version == "13.0.1" and "hf_secret" not in repr(img)
