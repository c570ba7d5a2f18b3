"""Facts parsed from real command output (tests/fixtures/), and fuzzed: any text gives a fact or a
ParseError, never another exception."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sparkctl.facts import node_facts as f

FIX = Path(__file__).resolve().parent.parent.parent / "fixtures"
PROBE = Path(f.__file__).resolve().parent.parent / "probes" / "node_facts.sh"


def fixture(path: str) -> str:
    return (FIX / path).read_text()


# ------------------------------------------------------------------------------------ nvidia-smi


def test_nvidia_smi_h200_noheader() -> None:
    four = ("name", "driver_version", "memory.total", "compute_cap")  # what the capture asked for
    (gpu,) = f.parse_nvidia_smi_query(fixture("nvidia-smi-h200/query-noheader.csv"), fields=four)
    assert gpu == f.Gpu(0, "NVIDIA H200", "580.159.04", 143771, "9.0", None)


def test_nvidia_smi_h200_with_header_and_units() -> None:
    (gpu,) = f.parse_nvidia_smi_query(fixture("nvidia-smi-h200/query.csv"))
    assert (gpu.name, gpu.memory_total_mib, gpu.compute_cap, gpu.count) == ("NVIDIA H200", 143771, "9.0", 1)


def test_nvidia_smi_gb10_unified_memory_is_none() -> None:
    four = ("name", "driver_version", "memory.total", "compute_cap")
    (gpu,) = f.parse_nvidia_smi_query(fixture("nvidia-smi-gb10/query-noheader.csv"), fields=four)
    assert gpu == f.Gpu(0, "NVIDIA GB10", "580.159.04", None, "12.1", None)
    (gpu,) = f.parse_nvidia_smi_query(fixture("nvidia-smi-gb10/query.csv"))
    assert (gpu.memory_total_mib, gpu.compute_cap, gpu.count) == (None, "12.1", 1)


def test_nvidia_smi_check_query_fields() -> None:
    # The five fields `check` asks for, "Not Supported" spelled the other way nvidia-smi spells it.
    gpus = f.parse_nvidia_smi_query("NVIDIA GB10, 580.159.04, Not Supported, 12.1, 1\n")
    assert gpus == [f.Gpu(0, "NVIDIA GB10", "580.159.04", None, "12.1", 1)]


@pytest.mark.parametrize(
    "text", ["", "NVIDIA H200, 580.159.04\n", "NVIDIA H200, 580, lots, 9.0, 1\n", "a,b,c,99x,1"]
)
def test_nvidia_smi_garbage(text: str) -> None:
    with pytest.raises(f.ParseError):
        f.parse_nvidia_smi_query(text)


@pytest.mark.parametrize("gpu", ["h200", "gb10"])
def test_nvidia_smi_banner(gpu: str) -> None:
    banner = f.parse_nvidia_smi_banner(fixture(f"nvidia-smi-{gpu}/plain.txt"))
    assert banner == f.NvidiaSmiBanner("580.159.04", "13.0")


def test_nvidia_smi_list() -> None:
    (entry,) = f.parse_nvidia_smi_list(fixture("nvidia-smi-gb10/L.txt"))
    assert entry == f.GpuListEntry(0, "NVIDIA GB10", "GPU-fdeda9c4-8c47-cdef-a8db-49a8150101ad")
    assert f.parse_nvidia_smi_list("") == []
    with pytest.raises(f.ParseError):
        f.parse_nvidia_smi_list("No devices were found\n")


# ---------------------------------------------------------------------------------- memory, limits


def test_meminfo_real() -> None:
    mem = f.parse_meminfo(fixture("host/proc-meminfo.txt"))
    assert mem.total_bytes == 24684096 * 1024 and mem.available_bytes == 24325384 * 1024


def test_meminfo_free_cache_and_swap_on_real_output() -> None:
    """The page cache the kernel can drop is Cached − Shmem + Buffers + SReclaimable, apart
    from MemFree (MemAvailable counts it as available; a GB10's CUDA does not get it back in time)."""
    mem = f.parse_meminfo(fixture("host/proc-meminfo-cache.txt"))
    assert mem.free_bytes == 18140048 * 1024
    assert mem.cache_bytes == (4563948 - 9512 + 124948 + 896276) * 1024
    assert mem.swap_used_bytes == 0
    swapped = f.parse_meminfo("MemTotal: 100 kB\nSwapTotal: 50 kB\nSwapFree: 20 kB\n")
    assert swapped.swap_used_bytes == 30 * 1024 and swapped.cache_bytes is None and swapped.free_bytes is None


def test_compute_apps_real_captures() -> None:
    """Real nvidia-smi output (an H200 with a python3 holding 10 GiB), with and without header and
    units, the idle answer, and the GB10 derivation where used_memory reads [N/A]."""
    want = [f.GpuApp(446, "python3", 10758)]
    assert f.parse_compute_apps(fixture("nvidia-smi-h200-process/compute-apps.csv")) == want
    four = ("pid", "process_name", "used_memory", "gpu_uuid")
    assert f.parse_compute_apps(fixture("nvidia-smi-h200-process/compute-apps-noheader-nounits.csv"), four) == want
    assert f.parse_compute_apps(fixture("nvidia-smi-h200-process/compute-apps-idle.csv")) == []
    assert f.parse_compute_apps("") == []
    assert f.parse_compute_apps(fixture("nvidia-smi-gb10/compute-apps-noheader-nounits.csv")) == [
        f.GpuApp(446, "python3", None)
    ]
    assert want[0].used_bytes == 10758 * 1024 * 1024


def test_compute_apps_container_and_odd_names() -> None:
    """The probe's @@cgroup lines name the container holding a pid; a name with commas stays one name;
    a line that is not a process is refused, not guessed."""
    cid = "ab" * 32
    text = f"446, python3, 10758\n9, vllm, serve,x, [N/A]\n@@cgroup 446 {cid}\n@@cgroup 12 {cid}\n"
    assert f.parse_compute_apps(text) == [f.GpuApp(446, "python3", 10758, cid), f.GpuApp(9, "vllm, serve,x", None)]
    with pytest.raises(f.ParseError, match="not a pid"):
        f.parse_compute_apps("-1, python3, 1\n")
    for bad in ("No running processes found\n", "x, python3, 1\n", "446, 10758\n", "446, p, lots\n"):
        with pytest.raises(f.ParseError):
            f.parse_compute_apps(bad)


def test_meminfo_without_memtotal() -> None:
    with pytest.raises(f.ParseError):
        f.parse_meminfo("MemFree: 1 kB\n")


@pytest.mark.parametrize(("text", "want"), [("20000\n", 20000), ("8192", 8192), ("unlimited\n", f.UNLIMITED)])
def test_ulimit(text: str, want: int) -> None:
    assert f.parse_ulimit(text) == want


@pytest.mark.parametrize("text", ["", "-1", "lots", "1 2"])
def test_ulimit_garbage(text: str) -> None:
    with pytest.raises(f.ParseError):
        f.parse_ulimit(text)


def test_format_limit() -> None:
    assert f.format_limit(f.UNLIMITED) == "unlimited" and f.format_limit(20000) == "20000"


# ----------------------------------------------------------------------------------------- network


def test_ip_addr_real() -> None:
    devs = {d.name: d for d in f.parse_ip_addr(fixture("host/ip-j-addr.json"))}
    assert devs["eth0"].is_up and devs["eth0"].ipv4[0].ip == ipaddress.IPv4Address("192.0.2.2")
    assert not devs["ifb0"].is_up and devs["ifb0"].ipv4 == ()
    assert devs["lo"].is_up and str(devs["lo"].ipv4[0]) == "127.0.0.1/8"


def test_ip_addr_down_link_with_address() -> None:
    text = json.dumps(
        [{"ifname": "enp1s0f0np0", "flags": ["BROADCAST", "MULTICAST", "UP"], "operstate": "DOWN",
          "addr_info": [{"family": "inet", "local": "192.168.100.11", "prefixlen": 24}]}]
    )  # fmt: skip
    (dev,) = f.parse_ip_addr(text)
    assert not dev.is_up and dev.ipv4 == (ipaddress.IPv4Interface("192.168.100.11/24"),)


def test_listening_ports_real() -> None:
    listeners = f.parse_listening_ports(fixture("host/ss-Hltn.txt"))
    assert listeners == [f.Listener("0.0.0.0", 2024)]
    assert f.ports_in_use(listeners, [2024, 8888]) == [2024]


def test_listening_ports_ipv6_and_wildcard() -> None:
    text = "LISTEN 0 4096 [::]:8888 [::]:*\nLISTEN 0 128 *:29501 *:*\nLISTEN 0 5 [::ffff:10.0.0.1]:22 *:*\n"
    assert [(x.address, x.port) for x in f.parse_listening_ports(text)] == [
        ("::", 8888),
        ("*", 29501),
        ("::ffff:10.0.0.1", 22),
    ]


def test_df_real() -> None:
    (disk,) = f.parse_df(fixture("host/df-PB1.txt"))
    assert disk == f.DiskUsage("/dev/vda", 270553174016, 24005951488, 84938342400, "/")


def test_df_mountpoint_with_spaces() -> None:
    text = "Filesystem 1-blocks Used Available Capacity Mounted on\nnfs:/x 100 40 60 40% /mnt/my models\n"
    assert f.parse_df(text)[0].mountpoint == "/mnt/my models"


# ------------------------------------------------------------------------------------------ docker


def test_docker_version_real() -> None:
    v = f.parse_docker_version(fixture("docker/version.json"))
    assert (v.client_version, v.server_version, v.api_version, v.arch) == (
        "28.2.2",
        "20.10.24+dfsg1",
        "1.41",
        "amd64",
    )


def test_docker_version_engine_down() -> None:
    v = f.parse_docker_version(fixture("docker/version-daemon-down.json"))
    assert v.client_version == "28.2.2" and v.server_version is None


def test_image_inspect_real() -> None:
    images = f.parse_image_inspect(fixture("docker/image-inspect.json"))
    base, dcp = images
    assert base.labels == {"sparkctl.layer": "base"} and dcp.layers[: len(base.layers)] == base.layers
    assert f.find_image(images, "sparkctl-test/dcp:1") is dcp
    assert f.find_image(images, dcp.id) is dcp and f.find_image(images, dcp.id[7:19]) is dcp
    assert f.find_image(images, "sparkctl-test/dcp:2") is None


def test_image_inspect_with_one_missing() -> None:
    (img,) = f.parse_image_inspect(fixture("docker/image-inspect-missing.json"))
    assert img.repo_tags == ("sparkctl-test/dcp:1",)
    assert f.parse_image_inspect("") == []


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        ("x", "x:latest"),
        ("x:1", "x:1"),
        ("docker.io/library/x:1", "x:1"),
        ("reg:5000/a/b", "reg:5000/a/b:latest"),
    ],
)
def test_normalize_image_ref(ref: str, want: str) -> None:
    assert f.normalize_image_ref(ref) == want


def test_docker_ps_real() -> None:
    (c,) = f.parse_docker_ps(fixture("docker/ps-a.jsonl"))
    assert c.names == "sparkctl-rank0" and c.state == "created"
    assert c.labels["sparkctl.cluster"] == "sparkctl" and c.labels["sparkctl.rank"] == "0"


# -------------------------------------------------------------------------------------- infiniband


def test_infiniband_records() -> None:
    text = "\n".join(
        [
            "hca\trocep1s0f1",
            "netdev\trocep1s0f1\tenp1s0f1np1",
            "port\trocep1s0f1\t1\t4: ACTIVE\tEthernet",
            "gid\trocep1s0f1\t1\t2\t0000:0000:0000:0000:0000:ffff:c0a8:640b\tIB/RoCE v1\tenp1s0f1np1",
            "gid\trocep1s0f1\t1\t3\t0000:0000:0000:0000:0000:ffff:c0a8:640b\tRoCE v2\tenp1s0f1np1",
            "gid\trocep1s0f1\t1\t4\t0000:0000:0000:0000:0000:ffff:c0a8:640b\t\t",
        ]
    )
    (hca,) = f.parse_infiniband(text)
    assert hca.netdevs == ("enp1s0f1np1",) and hca.ports[0].state == "ACTIVE"
    assert hca.ports[0].gids[0].ipv4 == ipaddress.IPv4Address("192.168.100.11")
    # Only the RoCE v2 entry; the one whose type could not be read is not a candidate.
    assert hca.roce_v2_gid_candidates("192.168.100.11") == [(1, 3)]
    assert hca.roce_v2_gid_candidates("192.168.100.12") == []
    assert f.hca_for_netdev([hca], "enp1s0f1np1") is hca and f.hca_for_netdev([hca], "eth0") is None


@pytest.mark.parametrize("text", ["bogus\tx", "hca\t$(x)", "gid\tmlx5_0\t1", "port\tmlx5_0\tone\t4: ACTIVE"])
def test_infiniband_garbage(text: str) -> None:
    with pytest.raises(f.ParseError):
        f.parse_infiniband(text)


# ---------------------------------------------------------------------------------- model listing


def test_model_listing() -> None:
    m = f.parse_model_listing("10\tmodel-00001-of-00002.safetensors\n20\tserving/exl3.py\n5\tconfig.json\n")
    assert m.exists and m.shards == {"model-00001-of-00002.safetensors": 10} and m.unlisted == 0
    # only a newline ends a line: \r, \x1c, \x85 (str.splitlines' other breaks) are bytes of a name
    m = f.parse_model_listing("0\tx\r5000\tm.safetensors\n0\ty\x1c9\tm.safetensors\nunlisted\n10\tm.safetensors\n")
    assert m.files == {"x\r5000\tm.safetensors": 0, "y\x1c9\tm.safetensors": 0, "m.safetensors": 10}
    assert m.unlisted == 1
    assert f.parse_model_listing("missing\n") == f.ModelListing(False, {})


def _listing_by_the_probe(tmp_path: Path, model: Path) -> f.ModelListing | None:
    """node_facts.sh's model section as a node runs it (the real `sh` and `find`), parsed as check does."""
    nonce = "0123456789abcdef"
    env = dict(os.environ, PATH=f"{tmp_path / 'nobin'}:{os.environ['PATH']}",
               DOCKER_HOST=f"unix://{tmp_path}/no-engine.sock")
    args = f.probe_args(model=str(model), docker=False, banner=False, listening=False)
    out = subprocess.run(["sh", "-s", "--", nonce, *args], input=PROBE.read_bytes(), capture_output=True,
                         env=env, timeout=60, cwd=tmp_path).stdout.decode("utf-8", "replace")
    return f.node_facts_from_probe(out, nonce, expect_docker=False, expect_banner=False,
                                   expect_listening=False).model


@pytest.mark.skipif(not shutil.which("sh") or not shutil.which("find"), reason="needs a POSIX shell")
def test_a_file_name_with_a_newline_and_a_tab_cannot_forge_another_entry(tmp_path: Path) -> None:
    """A truncated shard beside files whose names imitate the listing (`x<LF>5000<TAB>model-….safetensors`,
    the same with `\r`): the shard keeps its real size, so check sees the difference; a name with a
    newline is withheld (counted, and check warns), one with `\r` is one entry of its own."""
    from sparkctl.rules import check_rules as C

    shard = "model-00001-of-00001.safetensors"
    good, bad = tmp_path / "head" / "m", tmp_path / "rank" / "m"
    for d in (good, bad):
        (d / "serving").mkdir(parents=True)
        (d / "config.json").write_text("{}")
    (good / shard).write_bytes(b"x" * 5000)
    (bad / shard).write_bytes(b"x" * 10)  # cut short
    forged = f"x\n5000\t{shard}"
    (bad / forged).write_bytes(b"")
    (bad / "serving" / f"y\n5000\t{shard}").write_bytes(b"")
    (bad / f"z\r5000\t{shard}").write_bytes(b"")
    head, rank = _listing_by_the_probe(tmp_path, good), _listing_by_the_probe(tmp_path, bad)
    assert head is not None and rank is not None
    assert head.files == {shard: 5000, "config.json": 2} and head.unlisted == 0
    assert rank.files == {shard: 10, "config.json": 2, f"z\r5000\t{shard}": 0} and rank.unlisted == 2
    found = C.rule_model({"head": head, "rank": rank}, "head", "/m", {})
    assert found["head"].status == C.OK and found["rank"].status == C.FAIL
    assert "newline" in found["rank"].reason

    # alone, withheld names make an otherwise equal node a warning that says what to do
    (good / forged).write_bytes(b"")
    head = _listing_by_the_probe(tmp_path, good)
    assert head is not None and head.files == {shard: 5000, "config.json": 2} and head.unlisted == 1
    same = f.ModelListing(True, {shard: 5000, "config.json": 2})
    found = C.rule_model({"head": head, "rank": same}, "head", "/m", {})
    assert found["head"].status == C.WARN and found["rank"].status == C.OK
    assert "1 file" in found["head"].reason and "rename" in (found["head"].fix or "")


# --------------------------------------------------------- the whole probe, run here on a fake node


def _fake_sysfs(root: Path) -> None:
    """A tree shaped like /sys/class/infiniband on a DGX Spark whose fabric IP sits on the second
    QSFP port (rocep1s0f1 / enp1s0f1np1), with the RoCE v2 GID at index 3 and unreadable types for
    the unused slots (the real kernel answers EINVAL there)."""
    for hca, netdev, ip_hex in (
        ("rocep1s0f0", "enp1s0f0np0", None),
        ("rocep1s0f1", "enp1s0f1np1", "c0a8:640b"),
    ):
        (root / hca / "device" / "net" / netdev).mkdir(parents=True)
        port = root / hca / "ports" / "1"
        for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
            (port / sub).mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n" if ip_hex else "1: DOWN\n")
        (port / "link_layer").write_text("Ethernet\n")
        gids = ["fe80:0000:0000:0000:0000:0000:0000:0001"] * 2
        types = ["IB/RoCE v1", "RoCE v2"]
        if ip_hex:
            gids += [f"0000:0000:0000:0000:0000:ffff:{ip_hex}"] * 2
            types += ["IB/RoCE v1", "RoCE v2"]
        for i in range(8):
            (port / "gids" / str(i)).write_text((gids[i] if i < len(gids) else "0" * 4 + ":0000" * 7) + "\n")
            if i < len(types):
                (port / "gid_attrs" / "types" / str(i)).write_text(types[i] + "\n")
                (port / "gid_attrs" / "ndevs" / str(i)).write_text(netdev + "\n")


@pytest.mark.skipif(not shutil.which("sh") or not shutil.which("find"), reason="needs a POSIX shell")
def test_probe_script_end_to_end(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path / "ib")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # The lab's seam: an nvidia-smi first on PATH that prints what a GB10 prints.
    (bindir / "nvidia-smi").write_text(
        "#!/bin/sh\ncase \"$1\" in --query-gpu=*) echo 'NVIDIA GB10, 580.159.04, [N/A], 12.1, 1';;"
        f" *) cat {FIX}/nvidia-smi-gb10/plain.txt;; esac\n"
    )
    (bindir / "nvidia-smi").chmod(0o755)
    model = tmp_path / "my model $(touch canary)"
    (model / "serving").mkdir(parents=True)
    (model / "model-00001-of-00001.safetensors").write_bytes(b"x" * 10)
    (model / "serving" / "exl3.py").write_text("")
    nonce = "0123456789abcdef"
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SPARKCTL_SYSFS_ROOT=str(tmp_path / "ib"),
               DOCKER_HOST=f"unix://{tmp_path}/no-engine.sock")  # fmt: skip
    args = f.probe_args(
        model=str(model), cluster="c;$(x)", images=["lab/base:1"], df_paths=["/nonexistent/docker"]
    )
    out = subprocess.run(
        ["sh", "-s", "--", nonce, *args], input=PROBE.read_bytes(), capture_output=True, env=env, timeout=60,
        cwd=tmp_path,
    ).stdout.decode()  # fmt: skip
    facts = f.node_facts_from_probe(out, nonce)
    assert not (tmp_path / "canary").exists()
    assert facts.gpus == [f.Gpu(0, "NVIDIA GB10", "580.159.04", None, "12.1", 1)]
    assert facts.gpu_banner == f.NvidiaSmiBanner("580.159.04", "13.0")
    assert facts.meminfo and facts.meminfo.total_bytes > 0
    assert facts.nofile_hard and facts.memlock_hard_kib
    assert facts.netdevs and any(d.name == "lo" for d in facts.netdevs)
    assert facts.hcas is not None
    hcas = {h.name: h for h in facts.hcas}
    assert hcas["rocep1s0f1"].netdevs == ("enp1s0f1np1",)
    assert hcas["rocep1s0f1"].roce_v2_gid_candidates("192.168.100.11") == [(1, 3)]
    assert hcas["rocep1s0f0"].ports[0].state == "DOWN"
    assert facts.model and facts.model.shards == {"model-00001-of-00001.safetensors": 10}
    assert "serving/exl3.py" in facts.model.files
    assert facts.disks and facts.disks[0].mountpoint == "/"
    assert facts.listeners is not None
    # No engine behind DOCKER_HOST: the version fact has the client and no server, and says why.
    if shutil.which("docker"):
        assert facts.docker and facts.docker.server_version is None
        assert "docker-version" in facts.problems


def test_probe_sections_ignore_forged_markers() -> None:
    nonce = "00112233445566aa"
    forged = "@@sparkctl 00112233445566ab end model 0\n"
    text = f"@@sparkctl {nonce} begin model\n10\tx.safetensors\n{forged}\n@@sparkctl {nonce} end model 0\n"
    stderr = f"@@sparkctl {nonce} stderr model\nfind: x\n@@sparkctl 00112233445566ab stderr meminfo\n"
    secs = f.parse_probe_sections(text, nonce, stderr)
    assert secs["model"].stdout == f"10\tx.safetensors\n{forged}"
    assert secs["model"].stderr == "find: x\n@@sparkctl 00112233445566ab stderr meminfo\n"
    assert set(secs) == {"model"}
    facts = f.node_facts_from_probe(text, nonce, stderr)
    assert "model" in facts.problems  # the forged line is not a valid listing line
    assert "meminfo" in facts.problems  # a section that never arrived is reported, not guessed


def test_truncated_probe_output_is_reported() -> None:
    nonce = "00112233445566aa"
    text = f"@@sparkctl {nonce} begin meminfo\nMemTotal: 1 kB\n"
    facts = f.node_facts_from_probe(text, nonce)
    assert facts.meminfo is None and facts.problems["meminfo"].startswith("no output")


# ------------------------------------------------------------------------------------------- fuzz

PARSERS: list[Callable[[str], Any]] = [
    f.parse_nvidia_smi_query,
    f.parse_nvidia_smi_banner,
    f.parse_nvidia_smi_list,
    f.parse_meminfo,
    f.parse_compute_apps,
    f.parse_ulimit,
    f.parse_ip_addr,
    f.parse_listening_ports,
    f.parse_infiniband,
    f.parse_docker_version,
    f.parse_image_inspect,
    f.parse_docker_ps,
    f.parse_df,
    f.parse_model_listing,
    lambda t: f.parse_probe_sections(t, "00112233445566aa"),
]

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parses_or_parse_error(parser: Callable[[str], Any], text: str) -> None:
    """A parser returns what its signature promises, the same for the same text, or raises ParseError."""
    try:
        got = parser(text)
    except f.ParseError:
        return
    want = typing.get_type_hints(parser).get("return")
    if want is None:  # a lambda around a parser: the parser it wraps
        want = typing.get_type_hints(f.parse_probe_sections)["return"]
    assert isinstance(got, typing.get_origin(want) or want), (parser, type(got))
    assert parser(text) == got  # a pure function of its input


def _json_that_is_not_an_object(fn: Any) -> Any:
    """Explicit examples: valid JSON of the wrong shape, which random text almost never is."""
    for parser in (f.parse_ip_addr, f.parse_docker_version, f.parse_image_inspect, f.parse_docker_ps):
        for text in ("1", "[]", "null", '"x"', "[1, {}]", "{}"):
            fn = example(parser, text)(fn)
    return fn


@_json_that_is_not_an_object
@FUZZ
@given(st.sampled_from(PARSERS), st.text(max_size=400))
def test_fuzz_text(parser: Callable[[str], Any], text: str) -> None:
    _parses_or_parse_error(parser, text)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
KEYS = ["Id", "RepoTags", "Config", "Labels", "RootFS", "Layers", "Client", "Server", "Version", "ifname",
        "addr_info", "family", "local", "prefixlen", "flags", "operstate", "ID", "Names", "State"]  # fmt: skip
SHAPED = st.recursive(
    st.none()
    | st.integers()
    | st.text(max_size=12)
    | st.sampled_from(["inet", "UP", "LOWER_UP", "10.0.0.1"]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(KEYS), c, max_size=5),
    max_leaves=25,
)


@FUZZ
@given(
    st.sampled_from([f.parse_ip_addr, f.parse_docker_version, f.parse_image_inspect, f.parse_docker_ps]),
    JSON | SHAPED,
)
def test_fuzz_json_shapes(parser: Callable[[str], Any], value: Any) -> None:
    _parses_or_parse_error(parser, json.dumps(value))


REAL = [
    (f.parse_nvidia_smi_query, "nvidia-smi-h200/query.csv"),
    (f.parse_nvidia_smi_banner, "nvidia-smi-h200/plain.txt"),
    (f.parse_nvidia_smi_list, "nvidia-smi-h200/L.txt"),
    (f.parse_meminfo, "host/proc-meminfo.txt"),
    (f.parse_meminfo, "host/proc-meminfo-cache.txt"),
    (f.parse_compute_apps, "nvidia-smi-h200-process/compute-apps.csv"),
    (f.parse_compute_apps, "nvidia-smi-gb10/compute-apps-noheader-nounits.csv"),
    (f.parse_ip_addr, "host/ip-j-addr.json"),
    (f.parse_listening_ports, "host/ss-Hltn.txt"),
    (f.parse_df, "host/df-PB1.txt"),
    (f.parse_docker_version, "docker/version.json"),
    (f.parse_image_inspect, "docker/image-inspect.json"),
    (f.parse_docker_ps, "docker/ps-a.jsonl"),
]


@FUZZ
@given(st.sampled_from(REAL), st.data())
def test_fuzz_truncated_and_mutated_real_output(
    case: tuple[Callable[[str], Any], str], data: st.DataObject
) -> None:
    parser, path = case
    text = fixture(path)
    cut = data.draw(st.integers(0, len(text)))
    _parses_or_parse_error(parser, text[:cut])
    pos = data.draw(st.integers(0, max(0, len(text) - 1)))
    junk = data.draw(st.text(max_size=8))
    _parses_or_parse_error(parser, text[:pos] + junk + text[pos + 1 :])


def test_oversized_input_is_refused() -> None:
    with pytest.raises(f.ParseError, match="too large"):
        f.parse_meminfo("MemTotal: 1 kB\n" * (f.MAX_INPUT_CHARS // 10))


def test_deeply_nested_json_is_a_parse_error() -> None:
    with pytest.raises(f.ParseError):
        f.parse_ip_addr("[" * 100000 + "]" * 100000)


def test_kernel_firmware_cma_and_mtu_are_read() -> None:
    k = f.parse_kernel("release\t7.0.0-1019-nvidia\ncmdline\tro quiet cma=0\n")
    assert k.release == "7.0.0-1019-nvidia" and k.cma_param == "0"
    assert f.parse_kernel("release\t6.11.0\ncmdline\t\n").cma_param is None
    with pytest.raises(f.ParseError):
        f.parse_kernel("release\t$(reboot)\n")
    assert f.parse_firmware("rocep1s0f0\t28.45.1020\nroceP2p1s0f0\t28.45.1020\n") == {
        "rocep1s0f0": "28.45.1020", "roceP2p1s0f0": "28.45.1020"}
    with pytest.raises(f.ParseError):
        f.parse_firmware("no tab here\n")
    assert f.parse_meminfo("MemTotal: 100 kB\nCmaTotal: 0 kB\n").cma_total_bytes == 0
    assert f.parse_meminfo("MemTotal: 100 kB\n").cma_total_bytes is None
    dev = f.parse_ip_addr('[{"ifname": "enp1s0f0np0", "mtu": 1500, "operstate": "UP", "addr_info": []}]')[0]
    assert dev.mtu == 1500
