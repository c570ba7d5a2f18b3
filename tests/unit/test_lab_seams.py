"""The lab's hardware seams and host layout, offline (no root, no lab needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sparkctl.lab import seams
from sparkctl.lab.state import HostSpec, hosts_for

SMI = Path(seams.__file__).with_name("nvidia_smi.py")
# header and field order of the real capture (captures/nvidia-smi-h200/query.csv)
CAPTURED_HEADER = ("name, driver_version, memory.total [MiB], memory.used [MiB], memory.free [MiB], uuid, "
                   "pci.bus_id, compute_cap, count")


def smi(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SMI), *argv], capture_output=True, text=True, timeout=20)


def test_query_header_matches_the_real_capture() -> None:
    res = smi("--query-gpu=name,driver_version,memory.total,memory.used,memory.free,uuid,pci.bus_id,compute_cap,count",
              "--format=csv")
    header, row = res.stdout.splitlines()
    assert res.returncode == 0 and header == CAPTURED_HEADER
    assert row.startswith("NVIDIA GB10, 580.") and ", [N/A], [N/A], [N/A], GPU-" in row and row.endswith(", 12.1, 1")


def test_units_and_aliases() -> None:
    assert smi("--query-gpu=gpu_name,utilization.gpu,power.draw", "--format=csv,noheader").stdout == \
        "NVIDIA GB10, 0 %, 11.48 W\n"
    assert smi("--query-gpu=utilization.gpu,power.draw", "--format=csv,noheader,nounits").stdout == "0, 11.48\n"


def test_unknown_field_is_the_real_error() -> None:
    res = smi("--query-gpu=name,memory.totl", "--format=csv")
    assert res.returncode == 2 and res.stdout == 'Field "memory.totl" is not a valid field to query.\n\n'


def test_table_keeps_the_real_frame() -> None:
    lines = smi().stdout.splitlines()
    assert all(len(line) == 91 for line in lines[1:] if line)
    assert "NVIDIA GB10" in lines[8] and "Not Supported" in lines[9]


def test_gid_tables_put_roce_v2_where_the_spec_says() -> None:
    for spec in hosts_for(8):
        table = seams.gid_table(spec, spec.fabric_if, "02:00:00:00:00:01")
        gid, gtype = table[spec.gid_index]
        assert gtype == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff:")
        assert len(seams.gid_table(spec, spec.idle_if, "02:00:00:00:00:02")) == 2  # link-local pair only


def test_host_quirks() -> None:
    assert HostSpec.of(3).fabric_if == "enp1s0f1np1" and HostSpec.of(3).fabric_hca == "rocep1s0f1"
    assert HostSpec.of(1).fabric_if == "enp1s0f0np0" and HostSpec.of(2).gid_index == 5
    names = [s.veth_port(p) for s in hosts_for(16) for p in (0, 1)] + [s.veth_mgmt for s in hosts_for(16)]
    assert len(set(names)) == len(names) and max(map(len, names)) <= 15


def test_sysfs_tree_shape(tmp_path: Path) -> None:
    spec = HostSpec.of(2)
    macs = {"enp1s0f0np0": "02:00:00:00:00:01", "enp1s0f1np1": "02:00:00:00:00:02"}
    seams.write_sysfs(tmp_path, spec, macs, {"enp1s0f0np0": True, "enp1s0f1np1": False})
    port = tmp_path / "rocep1s0f0" / "ports" / "1"
    assert (port / "gid_attrs" / "types" / "5").read_text() == "RoCE v2\n"
    assert (port / "gids" / "5").read_text() == "0000:0000:0000:0000:0000:ffff:0ae8:000c\n"
    assert (port / "gid_attrs" / "ndevs" / "5").read_text() == "enp1s0f0np0\n"
    assert (tmp_path / "rocep1s0f1" / "ports" / "1" / "state").read_text() == "1: DOWN\n"
    assert (tmp_path / "rocep1s0f0" / "device" / "net" / "enp1s0f0np0").is_dir()


def test_the_lab_env_file_is_a_valid_cluster_input_with_replicas_where_hosts_split_into_fours(
        tmp_path: Path, clean_env: object) -> None:
    """`lab up --nodes N` writes TP=4 where N splits into fours (8 hosts: 2 replicas, as `demo --nodes 8`
    runs them), else TP=N; the settings load it as that topology."""
    from sparkctl.lab.manage import write_client_files
    from sparkctl.lab.state import HostPaths, LabFiles
    from sparkctl.spec.settings import load_settings

    files = LabFiles.of(tmp_path)
    files.root.mkdir(parents=True, exist_ok=True)
    for n, replicas in ((8, 2), (16, 4), (4, 1), (6, 1)):
        specs = hosts_for(n)
        for spec in specs:
            key = HostPaths.of(spec.name, files.root).host_key
            key.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{key}.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK lab\n")
        write_client_files(files, specs)
        s = load_settings(cli={}, environ={}, env_file=str(files.env_file))
        topo = s.topology
        assert len(topo.replicas) == replicas, (n, files.env_file.read_text())
        assert topo.heads == tuple(f"spark{1 + i * (n // replicas)}" for i in range(replicas))


def test_the_release_seam_lists_a_killed_engine_for_delay_s_after_its_container_stopped(tmp_path: Path) -> None:
    """The memory seam: the dead engine is listed only once a running container of the cluster was seen
    and then none, for delay_s from the first look that found none, then never again until the next
    run-then-stop. `docker ps` is a stand-in on PATH that prints what the test says runs."""
    import json
    import os

    bin_dir = tmp_path / "bin"
    seams.write_nvidia_smi(bin_dir, HostSpec.of(1))
    seams.set_gpu_seam(bin_dir, release={"cluster": "c", "delay_s": 10, "pid": 4194303,
                                         "process_name": "VLLM::Worker_TP", "used_memory": 60000})
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "docker").write_text(f"#!/bin/sh\ncat {tmp_path}/running\n")
    (fake / "docker").chmod(0o755)
    running = tmp_path / "running"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    seam = str(bin_dir / "nvidia_smi.py")
    query = ("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits")

    def look(now: float) -> str:
        code = (f"import json, importlib.util as u; s = u.spec_from_file_location('smi', {seam!r}); "
                "m = u.module_from_spec(s); s.loader.exec_module(m); "
                f"print(json.dumps(m.released(m.host_config(), now={now!r})))")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    running.write_text("")
    assert look(0) == "[]"  # never seen running: nothing to give back
    running.write_text("abc123\n")
    assert look(1) == "[]"  # running: its memory is its own
    running.write_text("")
    ghost = json.dumps([{"pid": 4194303, "process_name": "VLLM::Worker_TP", "used_memory": 60000}])
    assert look(5) == ghost and look(14.9) == ghost  # stopped at 5: listed until 15
    assert look(15) == "[]" and look(16) == "[]"  # given back, and stays so
    # The real CLI answers with the ghost row the same way while it is listed.
    running.write_text("abc123\n")
    subprocess.run([sys.executable, seam, *query], env=env, capture_output=True, text=True, timeout=20)
    running.write_text("")
    r = subprocess.run([sys.executable, seam, *query], env=env, capture_output=True, text=True, timeout=20)
    assert r.stdout == "4194303, VLLM::Worker_TP, 60000\n"
    seams.set_gpu_seam(bin_dir)
    assert "release" not in json.loads((bin_dir / "nvidia-smi.json").read_text())
    r = subprocess.run([sys.executable, seam, *query], env=env, capture_output=True, text=True, timeout=20)
    assert r.stdout == ""


def test_kernel_and_firmware_seams_reach_the_probes(tmp_path: Path) -> None:
    """node_facts.sh and diagnose.sh read a lab host's kernel release, command line, ring buffer and CX7
    firmware from its seams (set_kernel_seam, set_firmware), and the machine's own once they are undone."""
    import os

    from sparkctl.facts import node_facts as F
    from sparkctl.spec.resources import probe_script

    spec = HostSpec.of(2)
    sysfs, kernel = tmp_path / "sysfs", tmp_path / "kernel"
    seams.write_sysfs(sysfs, spec, {i: "02:00:00:00:00:0" + str(n) for n, i in enumerate(("enp1s0f0np0", "enp1s0f1np1"))},
                      {spec.fabric_if: True})
    seams.set_firmware(sysfs, "28.39.1002")
    seams.set_kernel_seam(kernel, release="7.0.0-1019-nvidia", cmdline="ro cma=0", kmsg=["x", "Out of memory: Killed process 1"])
    NONCE = "0123456789abcdef"
    env = {**os.environ, "SPARKCTL_SYSFS_ROOT": str(sysfs), "SPARKCTL_KERNEL_SEAM": str(kernel)}

    def facts() -> F.NodeFacts:
        r = subprocess.run(["sh", "-s", "--", NONCE, "docker=no"], input=probe_script("node_facts.sh"), env=env,
                           capture_output=True, timeout=60)
        return F.node_facts_from_probe(r.stdout.decode(), NONCE, r.stderr.decode(), expect_docker=False)

    got = facts()
    assert got.kernel is not None and got.kernel.release == "7.0.0-1019-nvidia" and got.kernel.cma_param == "0"
    assert got.firmware and set(got.firmware.values()) == {"28.39.1002"}
    r = subprocess.run(["sh", "-s", "--", NONCE, "c", "5", "5"],
                       input=probe_script("kernel_lines.sh") + b"\n" + probe_script("diagnose.sh"),
                       env=env, capture_output=True, timeout=60)
    sections = F.parse_probe_sections(r.stdout.decode(), NONCE, r.stderr.decode())
    assert sections["kernel-lines"].stdout.strip() == "Out of memory: Killed process 1"
    assert "fw 28.39.1002" in sections["fabric"].stdout
    seams.set_kernel_seam(kernel)
    seams.set_firmware(sysfs)
    got = facts()
    assert got.kernel is not None and got.kernel.release == os.uname().release
    assert got.firmware and set(got.firmware.values()) == {seams.LAB_FW}


NETPLAN_APPLY = Path(seams.__file__).with_name("netplan_apply.sh")
FAKE_IP = """#!/bin/sh
echo "$*" >>"$IP_LOG"
case "$*" in
  "-o -4 addr show dev enp1s0f0np0 scope global") echo "5: enp1s0f0np0    inet 10.232.0.11/24 brd x scope global";
                                                  echo "5: enp1s0f0np0    inet 192.168.100.1/24 brd x scope global" ;;
esac
exit 0
"""


def _setup_root_with_fabric_yaml(tmp_path: Path, address: str) -> Path:
    """A node's setup root holding setup's netplan file: enp1s0f0np0 at `address`, MTU 9000 (mode 0600, as
    setup writes it)."""
    root = tmp_path / "root"
    (root / "etc" / "netplan").mkdir(parents=True)
    yaml = root / "etc" / "netplan" / "60-sparkctl-fabric.yaml"
    yaml.write_text("network:\n  version: 2\n  ethernets:\n    enp1s0f0np0:\n      dhcp4: false\n"
                    f"      addresses: [{address}]\n      mtu: 9000\n")
    yaml.chmod(0o600)
    return root


def test_the_netplan_apply_seam_applies_what_the_real_netplan_generate_makes(tmp_path: Path) -> None:
    """The lab's `netplan apply`: the real `netplan generate` turns setup's YAML into networkd files, and the
    seam applies exactly their addresses and MTU to the links they name (an `ip` that records its calls),
    removing an IPv4 address the file does not list; a port the YAML leaves out is not touched."""
    import shutil

    import pytest

    if shutil.which("netplan") is None and not Path("/usr/sbin/netplan").exists():
        if __import__("os").environ.get("CI"):
            pytest.fail("netplan is not installed (netplan.io is in one-shot.sh's TEST_PACKAGES)")
        pytest.skip("netplan is not installed")
    root = _setup_root_with_fabric_yaml(tmp_path, "192.168.100.1/24")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ip").write_text(FAKE_IP)
    (bin_dir / "ip").chmod(0o755)
    log = tmp_path / "ip.log"
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "IP_LOG": str(log)}
    r = subprocess.run(["sh", str(NETPLAN_APPLY), str(root)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls == [
        "link show dev enp1s0f0np0",
        "link set dev enp1s0f0np0 mtu 9000",
        "-o -4 addr show dev enp1s0f0np0 scope global",
        "addr del 10.232.0.11/24 dev enp1s0f0np0",
        "addr replace 192.168.100.1/24 dev enp1s0f0np0",
        "link set dev enp1s0f0np0 up",
    ]
    assert "enp1s0f1np1" not in log.read_text()


def test_the_netplan_apply_seam_moves_a_port_to_another_address_of_its_subnet_on_the_real_kernel(
        tmp_path: Path) -> None:
    """In a network namespace of its own, on a veth link with the real `ip`: a port at 10.232.0.11/24 that
    setup's file puts at 10.232.0.1/24 ends with exactly that address (the kernel drops a subnet's secondary
    addresses with its primary one: the old address must go before the new one comes)."""
    import os
    import shutil

    import pytest

    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("netplan") is None:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root with unshare and netplan (one-shot.sh's TEST_PACKAGES)")
        pytest.skip("needs root, unshare and netplan")
    root = _setup_root_with_fabric_yaml(tmp_path, "10.232.0.1/24")
    script = ("set -e; ip link add enp1s0f0np0 type veth peer name peer0; ip addr add 10.232.0.11/24 dev enp1s0f0np0; "
              f"ip link set enp1s0f0np0 up; sh {NETPLAN_APPLY} {root} >/dev/null; "
              "ip -o -4 addr show dev enp1s0f0np0 | awk '{print $4}'; ip -o link show dev enp1s0f0np0")
    r = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SPARKCTL_SYSFS_ROOT": str(tmp_path / "sysfs")})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "10.232.0.1/24" and len([ln for ln in lines if "/" in ln and "mtu" not in ln]) == 1, r.stdout
    assert "mtu 9000" in lines[-1]


def test_the_gid_table_follows_the_ports_addresses_as_the_kernels_does(tmp_path: Path) -> None:
    """roce_gids.rewrite on the tree write_sysfs made: the IPv4-mapped RoCE v1/v2 pair of the old address is
    replaced by one pair per new address, after the link-local (and IPv6) entries, which stay where they were;
    no address: only those remain. The GID index of RoCE v2 for the first address is what `check` pins."""
    import ipaddress

    from sparkctl.lab import roce_gids
    from sparkctl.lab.state import PORT_HCAS, PORT_IFS

    spec = HostSpec.of(2)
    macs = {p: f"02:00:00:00:02:0{i}" for i, p in enumerate(PORT_IFS)}
    seams.write_sysfs(tmp_path, spec, macs, {p: True for p in PORT_IFS})
    port = tmp_path / PORT_HCAS[PORT_IFS.index(spec.fabric_if)] / "ports" / "1"
    gids = lambda: [(port / "gids" / str(n)).read_text().strip() for n in range(seams.GID_SLOTS)]  # noqa: E731
    kinds = lambda: [(port / "gid_attrs" / "types" / str(n)).read_text().strip() for n in range(seams.GID_SLOTS)]  # noqa: E731
    before = gids()
    assert before[spec.gid_index] == seams.gid_text(ipaddress.IPv6Address(f"::ffff:{spec.fabric_ip}"))
    roce_gids.rewrite(port, spec.fabric_if, ["192.168.100.2", "192.168.100.9"])
    after = gids()
    assert after[:spec.gid_index - 1] == before[:spec.gid_index - 1]  # link-local (and IPv6) entries kept
    assert after[spec.gid_index] == "0000:0000:0000:0000:0000:ffff:c0a8:6402"
    assert after[spec.gid_index + 2] == "0000:0000:0000:0000:0000:ffff:c0a8:6409"
    assert kinds()[spec.gid_index] == "RoCE v2" and kinds()[spec.gid_index - 1] == "IB/RoCE v1"
    roce_gids.rewrite(port, spec.fabric_if, [])
    assert all(g == seams.ZERO_GID for g in gids()[spec.gid_index - 1:]) and kinds()[spec.gid_index] == ""
