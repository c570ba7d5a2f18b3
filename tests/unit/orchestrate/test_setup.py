"""`setup`'s whole flow on local nodes (every remote script really runs, each node's / redirected into a folder of
its own by SPARKCTL_SETUP_ROOT): plan lists every change and touches nothing; --yes writes each file (validated
by the real netplan and visudo), runs the commands, confirms netplan over a new connection, audits; a second
plan has nothing to change; a node that cannot be reached after netplan apply restores its old file by itself."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import Cluster, NodeError
from sparkctl.errors import UsageError
from sparkctl.orchestrate import setup as flow
from sparkctl.spec import setup_plan as sp
from sparkctl.spec.settings import load_settings
from tests.unit.localnodes import LocalNodes, local_nodes

pytestmark = pytest.mark.skipif(os.environ.get("CI") != "true" and not (shutil.which("netplan") and shutil.which("visudo")),
                                reason="needs netplan (netplan.io) and visudo (sudo)")

NODES = ["n1", "n2"]
PORTS = ("enp1s0f0np0", "enp1s0f1np1")

IP_STUB = r"""#!/bin/sh
S=$SPARKCTL_SETUP_ROOT
case "$*" in
  "-j addr show") cat "$S/ip-addr.json" ;;
  "-j route get "*) printf '[{"dst":"%s","dev":"eth0"}]\n' "$4" ;;
  "-j -6 neigh show dev "*) cat "$S/neigh-$6.json" 2>/dev/null || echo '[]' ;;
  "-o link show dev "*) python3 -c 'import json, sys
for link in json.load(open(sys.argv[1])):
    if link["ifname"] == sys.argv[2]:
        print("2: %s: <%s> mtu %d" % (link["ifname"], ",".join(link.get("flags", [])), link.get("mtu", 1500)))' \
    "$S/ip-addr.json" "$5" ;;
  *) echo "ip stub: $*" >&2; exit 1 ;;
esac
"""
# ping on a port: a reply from every neighbour of the node's table for that port (iputils' words)
PING_STUB = r"""#!/bin/sh
while [ $# -gt 1 ]; do [ "$1" = -I ] && dev=$2; shift; done
python3 -c 'import json, sys
for n in json.load(open(sys.argv[1])):
    print("64 bytes from %s%%%s: icmp_seq=1 ttl=64 time=0.1 ms" % (n["dst"], sys.argv[2]))' \
  "$SPARKCTL_SETUP_ROOT/neigh-$dev.json" "$dev" 2>/dev/null
exit 0
"""
# What the lab's hosts need too: apply exactly what `netplan generate` derives from the node's netplan folder.
APPLY_SEAM = r"""#!/usr/bin/env python3
import json, pathlib, subprocess, sys
root = pathlib.Path(sys.argv[1])
gen = root / ".netplan-generated"
subprocess.run(["rm", "-rf", str(gen)], check=True)
(gen / "etc").mkdir(parents=True)
if (root / "etc/netplan").exists():
    subprocess.run(["cp", "-a", str(root / "etc/netplan"), str(gen / "etc/")], check=True)
subprocess.run(["netplan", "generate", "--root-dir", str(gen)], check=True)
want = {}
for f in (gen / "run/systemd/network").glob("*.network") if (gen / "run/systemd/network").exists() else []:
    kv = [ln.split("=", 1) for ln in f.read_text().splitlines() if "=" in ln]
    d = {}
    for k, v in kv:
        d.setdefault(k, []).append(v)
    want[d["Name"][0]] = (d.get("Address", []), int(d.get("MTUBytes", ["1500"])[0]))
links = json.loads((root / "ip-addr.json").read_text())
for link in links:
    if link["ifname"].startswith("enp"):
        addrs, mtu = want.get(link["ifname"], ([], 1500))
        link["mtu"] = mtu
        link["addr_info"] = [{"family": "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1])}
                             for a in addrs]
(root / "ip-addr.json").write_text(json.dumps(links))
"""


def mac(i: int, p: int) -> str:
    return f"02:00:00:00:{i:02x}:{p:02x}"


def _scene(ln: LocalNodes, root: Path) -> None:
    for i, n in enumerate(NODES, start=1):
        hw = root / "hw" / n
        r = hw / "root"
        (r / "etc").mkdir(parents=True)
        (r / "sbin").mkdir()
        (r / "etc/machine-id").write_text(f"{i:032x}\n")
        (r / "groups").write_text("spark\n")
        links = [{"ifname": "eth0", "flags": ["UP", "LOWER_UP"], "operstate": "UP", "mtu": 1500,
                  "address": f"aa:00:00:00:00:{i:02x}",
                  "addr_info": [{"family": "inet", "local": f"10.0.0.{i}", "prefixlen": 24}]}]
        links += [{"ifname": p, "flags": ["BROADCAST", "UP", "LOWER_UP"], "operstate": "UP", "mtu": 1500,
                   "address": mac(i, j), "addr_info": []} for j, p in enumerate(PORTS)]
        (r / "ip-addr.json").write_text(json.dumps(links))
        # one cable: each node's first port to the other's first port
        (r / f"neigh-{PORTS[0]}.json").write_text(json.dumps([{"dst": "fe80::1", "lladdr": mac(3 - i, 0)}]))
        stubs = {
            "ip": IP_STUB,
            "ping": PING_STUB,
            "id": '#!/bin/sh\ncase "$1" in -un) echo spark ;; -u) echo 1000 ;; -Gn) tr "\\n" " " <"$SPARKCTL_SETUP_ROOT/groups"; echo ;; '
                  '*) exec /usr/bin/id "$@" ;; esac\n',
            "sudo": '#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n',
            "getent": "#!/bin/sh\necho docker:x:999:\n",
            "nvidia-ctk": "#!/bin/sh\nexit 0\n",
        }
        for name, text in stubs.items():
            (hw / "bin" / name).write_text(text)
            (hw / "bin" / name).chmod(0o755)
        sbin = {
            "usermod": '#!/bin/sh\necho docker >>"$SPARKCTL_SETUP_ROOT/groups"\n',
            "apt-get": '#!/bin/sh\nmkdir -p "$SPARKCTL_SETUP_ROOT/usr/bin"\n'
                       'printf "#!/bin/sh\\n" >"$SPARKCTL_SETUP_ROOT/usr/bin/earlyoom"\n'
                       'chmod 755 "$SPARKCTL_SETUP_ROOT/usr/bin/earlyoom"\necho "apt-get $*" >>"$SPARKCTL_SETUP_ROOT/ran"\n',
            "systemctl": '#!/bin/sh\necho "systemctl $*" >>"$SPARKCTL_SETUP_ROOT/ran"\n',
        }
        for name, text in sbin.items():
            (r / "sbin" / name).write_text(text)
            (r / "sbin" / name).chmod(0o755)
    seam = root / "apply-seam"
    seam.write_text(APPLY_SEAM)
    seam.chmod(0o755)


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[LocalNodes, Any]]:
    root = tmp_path / "lab"
    with local_nodes(monkeypatch, root, NODES) as ln:
        _scene(ln, root)
        plain = LocalNodes.env_for

        def env_for(self: LocalNodes, name: str) -> dict[str, str]:
            i = NODES.index(name) + 1
            return {**plain(self, name), "SPARKCTL_SETUP_ROOT": str(root / "hw" / name / "root"),
                    "SSH_CONNECTION": f"10.0.0.100 50000 10.0.0.{i} 22",
                    "SPARKCTL_NETPLAN_APPLY": str(root / "apply-seam")}

        monkeypatch.setattr(LocalNodes, "env_for", env_for)
        s = load_settings(cli={}, environ={"NODES": " ".join(NODES), "MODEL": "/m", "RECIPE": "lab", "TP": "2", "DCP": "1",
                                           "CLUSTER_NAME": "t", "SERVED_MODEL_NAME": "m"})
        yield ln, s


def _root(ln: LocalNodes, n: str) -> Path:
    return ln.root / "hw" / n / "root"


def _plan(s: Any) -> flow.SetupReport:
    with Cluster(s.nodes, os.environ["SPARKCTL_SSH_CONFIG"]) as c:
        return flow.plan(c, s)


def _revert_timers(marks: list[Path], bound_s: float = 10.0) -> list[str]:
    """The netplan revert timers still running for these pending marks (their argv names the mark), after
    waiting up to bound_s for them to end: a confirmed try's timer looks at its mark every second."""
    want = [str(m).encode() for m in marks]
    deadline = time.monotonic() + bound_s
    while True:
        left = []
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"sparkctl-netplan-revert" in argv and any(w in argv for w in want):
                left.append(proc.name)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_plan_changes_nothing_yes_applies_everything_and_a_second_plan_has_nothing_to_do(nodes: Any) -> None:
    ln, s = nodes
    before = {n: sorted(p.relative_to(_root(ln, n)) for p in _root(ln, n).rglob("*")) for n in NODES}
    report = _plan(s)
    assert report.cabling.layout == "direct pair"
    assert {(c["node"], c.get("path") or c["command"]) for c in report.changes} == {
        (n, x) for n in NODES for x in (sp.NETPLAN_PATH, sp.SUDOERS_PATH, sp.LIMITS_PATH, sp.EARLYOOM_PATH,
                                        sp.fabric_doc_path("t"), "netplan apply", "usermod -aG docker spark",
                                        sp.COMMANDS["install-earlyoom"], "systemctl restart earlyoom")}
    assert {n: sorted(p.relative_to(_root(ln, n)) for p in _root(ln, n).rglob("*")) for n in NODES} == before

    with Cluster(s.nodes, os.environ["SPARKCTL_SSH_CONFIG"]) as c:
        flow.apply(c, s, report, os.environ["SPARKCTL_SSH_CONFIG"], try_s=600)
    assert report.failed == [], report.applied
    assert {o.status for o in (report.applied or {}).values()} == {"applied"}
    r1 = _root(ln, "n1")
    netplan = (r1 / "etc/netplan/60-sparkctl-fabric.yaml").read_text()
    assert "enp1s0f0np0:" in netplan and "192.168.100.1/24" in netplan and "enp1s0f1np1" not in netplan
    assert oct((r1 / "etc/sudoers.d/sparkctl").stat().st_mode & 0o777) == "0o440"
    live = {x["ifname"]: x for x in json.loads((r1 / "ip-addr.json").read_text())}
    assert live["enp1s0f0np0"]["addr_info"][0]["local"] == "192.168.100.1" and live["enp1s0f0np0"]["mtu"] == 9000
    assert live["eth0"]["addr_info"][0]["local"] == "10.0.0.1"
    assert not (r1 / "etc/sparkctl/t/netplan.pending").exists()  # confirmed: the try ended
    timers = _revert_timers([_root(ln, n) / "etc/sparkctl/t/netplan.pending" for n in NODES])
    assert timers == [], f"the revert timers of a confirmed try still run (of a {600} s try): {timers}"
    docs = {(_root(ln, n) / "etc/sparkctl/t/fabric.json").read_text() for n in NODES}
    assert len(docs) == 1 and json.loads(docs.pop())["ports"]["n2"]["enp1s0f0np0"]["peers"] == ["n1:enp1s0f0np0"]
    audit = (ln.home("n1") / ".sparkctl/t/audit.log").read_text()
    assert "wrote /etc/sudoers.d/sparkctl" in audit and "netplan-apply" in audit
    assert not list(r1.rglob(".sparkctl.*"))  # no temp file left

    again = _plan(s)
    assert again.changes == []


def test_the_fabric_document_is_stale_until_setup_ran_and_again_when_a_port_changes(nodes: Any) -> None:
    """document_disagrees (deploy's cheap probe, no neighbour discovery): no document, then a document that
    matches every recorded port, then an address changed by hand, each said in words."""
    ln, s = nodes
    with Cluster(s.nodes, os.environ["SPARKCTL_SSH_CONFIG"]) as c:
        assert flow.document_disagrees(c, s) == "n1 has no fabric document of cluster 't'"
        flow.apply(c, s, flow.plan(c, s), os.environ["SPARKCTL_SSH_CONFIG"], try_s=600)
        assert flow.document_disagrees(c, s) is None
        live = _root(ln, "n2") / "ip-addr.json"
        live.write_text(live.read_text().replace("192.168.100.2", "192.168.100.7"))
        assert flow.document_disagrees(c, s) == ("n2: port enp1s0f0np0 lacks 192.168.100.2/24, its address in the "
                                                 "fabric document")


def test_a_file_the_real_tool_refuses_leaves_every_file_of_that_node_as_it_was(nodes: Any) -> None:
    ln, s = nodes
    report = _plan(s)
    bad = report.plans["n2"]
    bad.files = [sp.DesiredFile(f.path, f.content.replace("NOPASSWD:", "NOPASSWD"), f.mode, f.check, f.what)
                 if f.check == "sudoers" else f for f in bad.files]
    with Cluster(s.nodes, os.environ["SPARKCTL_SSH_CONFIG"]) as c:
        flow.apply(c, s, report, os.environ["SPARKCTL_SSH_CONFIG"], try_s=600)
    assert report.failed == ["n2"]
    out = (report.applied or {})["n2"]
    assert "visudo -cf refused /etc/sudoers.d/sparkctl" in (out.error or "") and out.wrote == []
    r2 = _root(ln, "n2")
    assert not (r2 / "etc/netplan").exists() and not (r2 / "etc/sudoers.d/sparkctl").exists()
    assert not (r2 / "etc/security").exists() and not list(r2.rglob(".sparkctl.*"))
    assert (report.applied or {})["n1"].status == "applied"  # the other node completed


def test_a_node_unreachable_after_netplan_apply_restores_its_old_file_by_itself(nodes: Any, monkeypatch: Any) -> None:
    from sparkctl.cluster import fanout

    ln, s = nodes
    report = _plan(s)
    with Cluster(s.nodes, os.environ["SPARKCTL_SSH_CONFIG"]) as c:
        plain = fanout.connect

        def refuse_n2(target: Any, **kw: Any) -> Any:
            if target.alias == "n2":
                raise NodeError("n2", "timeout", "connect timed out")
            return plain(target, **kw)

        monkeypatch.setattr(fanout, "connect", refuse_n2)  # the connection already open stays
        flow.apply(c, s, report, os.environ["SPARKCTL_SSH_CONFIG"], try_s=1)
    out = (report.applied or {})["n2"]
    assert report.failed == ["n2"] and "no new SSH connection after netplan apply" in (out.error or "")
    assert "restores its previous netplan file" in (out.fix or "")
    r2 = _root(ln, "n2")
    for _ in range(300):  # the node's own timer: bounded wait for it, no claim on its speed
        if (r2 / "etc/sparkctl/t/netplan.reverted").exists():
            break
        time.sleep(0.1)
    assert not (r2 / "etc/netplan/60-sparkctl-fabric.yaml").exists()
    live = {x["ifname"]: x for x in json.loads((r2 / "ip-addr.json").read_text())}
    assert live["enp1s0f0np0"]["addr_info"] == [] and live["enp1s0f0np0"]["mtu"] == 1500
    assert (_root(ln, "n1") / "etc/netplan/60-sparkctl-fabric.yaml").exists()


def test_bad_input_is_refused_before_anything_is_touched(nodes: Any, monkeypatch: Any) -> None:
    ln, s = nodes
    (_root(ln, "n2") / "etc/machine-id").write_text(f"{1:032x}\n")
    with pytest.raises(UsageError, match="^n1 and n2 have one machine-id"):
        _plan(s)
    (_root(ln, "n2") / "etc/machine-id").write_text(f"{2:032x}\n")
    s2 = load_settings(cli={}, environ={"NODES": " ".join(NODES), "MODEL": "/m", "RECIPE": "lab", "TP": "2", "DCP": "1",
                                        "CLUSTER_NAME": "t", "SERVED_MODEL_NAME": "m", "FABRIC_SUBNET": "10.0.0.0/16"})
    with pytest.raises(UsageError, match="overlaps the management network 10.0.0.0/24"):
        _plan(s2)
    (_root(ln, "n1") / f"neigh-{PORTS[0]}.json").write_text(json.dumps([{"dst": "fe80::9", "lladdr": mac(1, 1)}]))
    with pytest.raises(UsageError, match="n1: port enp1s0f0np0 is cabled to its own port enp1s0f1np1"):
        _plan(s)
    assert not any((_root(ln, n) / "etc" / d).exists() for n in NODES for d in ("netplan", "sudoers.d", "sparkctl"))


def _cli(ln: LocalNodes, *args: str, env: dict[str, str] | None = None) -> Any:
    from click.testing import CliRunner

    from sparkctl.cli import cli

    base = {"NODES": " ".join(NODES), "MODEL": "/m", "RECIPE": "lab", "TP": "2", "DCP": "1", "CLUSTER_NAME": "t",
            "SERVED_MODEL_NAME": "m", "SPARKCTL_ENV_FILE": str(ln.root / "none.env")}
    (ln.root / "none.env").write_text("")
    return CliRunner().invoke(cli, list(args), env={**base, **(env or {})})


def test_the_command_plans_in_json_applies_with_yes_and_then_has_nothing_to_change(nodes: Any) -> None:
    ln, _ = nodes
    r = _cli(ln, "setup", "--plan", "--yes")
    assert getattr(r.exception, "exit_code", None) == 2 and "pick one" in str(r.exception)  # bad input: nothing runs
    r = _cli(ln, "setup", "--plan", "--json")  # --plan: the default, said out loud (as deploy takes it)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["cabling"]["layout"] == "direct pair" and len(doc["changes"]) == 18
    assert {"node", "what", "path", "sha256_before", "sha256_after"} <= set(doc["changes"][0])
    assert not (_root(ln, "n1") / "etc/netplan").exists()
    r = _cli(ln, "setup", "--yes")
    assert r.exit_code == 0, r.output
    r = _cli(ln, "setup", "--json")
    assert json.loads(r.stdout)["changes"] == []
    r = _cli(ln, "setup")
    assert r.exit_code == 0 and "nothing to change" in r.output


def test_bad_input_through_the_command_is_exit_2_with_one_json_failure(nodes: Any, monkeypatch: Any,
                                                                       capsys: Any) -> None:
    from sparkctl import cli

    ln, _ = nodes
    for k, v in {"NODES": " ".join(NODES), "MODEL": "/m", "RECIPE": "lab", "TP": "2", "DCP": "1",
                 "CLUSTER_NAME": "t", "SERVED_MODEL_NAME": "m", "FABRIC_SUBNET": "10.0.0.0/8"}.items():
        monkeypatch.setenv(k, v)
    (ln.root / "none.env").write_text("")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--env-file", str(ln.root / "none.env"), "setup", "--json"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "overlaps the management network" in doc["error"]
    assert "Traceback" not in out + err
    assert not (_root(ln, "n1") / "etc/netplan").exists()


@pytest.mark.skipif(os.environ.get("CI") != "true" and not shutil.which("iperf3"), reason="needs iperf3")
def test_each_cable_is_measured_by_real_iperf3_over_its_fabric_addresses(nodes: Any) -> None:
    """Loopback stands in for the cable: FABRIC_SUBNET in 127/8, so both ends' addresses are this machine's."""
    ln, _ = nodes
    s = load_settings(cli={}, environ={"NODES": " ".join(NODES), "MODEL": "/m", "RECIPE": "lab", "TP": "2", "DCP": "1",
                                       "CLUSTER_NAME": "t", "SERVED_MODEL_NAME": "m", "FABRIC_SUBNET": "127.77.0.0/24"})
    with Cluster(s.nodes, os.environ["SPARKCTL_SSH_CONFIG"]) as c:
        report = flow.plan(c, s)
        assert report.addresses == {("n1", PORTS[0]): "127.77.0.1", ("n2", PORTS[0]): "127.77.0.2"}
        flow.measure_cables(c, s, report, seconds=1)
    got = (report.speeds or {})[f"n1:{PORTS[0]} <-> n2:{PORTS[0]}"]
    assert isinstance(got, float) and got > 0, report.speeds
    assert report.to_dict()["cables"][0]["gbit_per_s"] == got
    # an end whose address is not there: the cable is named with iperf3's own reason, as a warning
    with Cluster(s.nodes, os.environ["SPARKCTL_SSH_CONFIG"]) as c:
        report.addresses[("n1", PORTS[0])] = "192.0.2.1"  # not this machine's: bind fails
        flow.measure_cables(c, s, report, seconds=1)
    assert report.speed_warnings and report.speed_warnings[0].startswith(f"cable n1:{PORTS[0]} <-> n2:{PORTS[0]}: "
                                                                          "not measured")
