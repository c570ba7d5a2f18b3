"""check against the fabric document `setup` left: a port gone, down, readdressed or with another MAC fails,
naming the port and `sparkctl setup`; a node without a document, or as recorded, adds nothing."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sparkctl.facts import node_facts as F
from sparkctl.rules.check_rules import FAIL, rule_fabric_record

DOC = {"ports": {"s1": {"p0": {"address": "192.168.100.1/30", "mac": "02:00:00:00:01:00", "peers": ["s2:p0"]}}}}


def facts(doc: Any, *, up: bool = True, addr: str = "192.168.100.1/30", mac: str = "02:00:00:00:01:00",
          name: str = "p0") -> F.NodeFacts:
    dev = F.NetDev(name, "UP" if up else "DOWN", ("UP", "LOWER_UP") if up else ("UP",),
                   (ipaddress.IPv4Interface(addr),), mac)
    return F.NodeFacts(netdevs=[dev], fabric_record=doc)


def test_as_recorded_or_without_a_document_adds_nothing() -> None:
    assert rule_fabric_record("s1", facts(DOC)) is None
    assert rule_fabric_record("s1", facts(None)) is None
    assert rule_fabric_record("s1", facts({"ports": "x"})) is None


@pytest.mark.parametrize(("scene", "said"), [
    (dict(up=False), "port p0 (cabled to s2:p0) is down"),
    (dict(name="p9"), "port p0 (cabled to s2:p0) is gone"),
    (dict(addr="10.0.0.5/24"), "port p0 has address 10.0.0.5/24, not 192.168.100.1/30"),
    (dict(mac="02:00:00:00:09:09"), "port p0's MAC is 02:00:00:00:09:09, not 02:00:00:00:01:00"),
])
def test_a_port_unlike_the_record_fails_naming_it_and_setup(scene: dict[str, Any], said: str) -> None:
    f = rule_fabric_record("s1", facts(DOC, **scene))
    assert f is not None and f.status == FAIL and f.check == "fabric"
    assert said in f.reason and "`sparkctl setup`" in f.fix and "\n" not in f.fix


def test_the_node_facts_parser_reads_the_document_or_none() -> None:
    assert F.parse_fabric_record("") is None
    assert F.parse_fabric_record('{"ports": {}}') == {"ports": {}}
    with pytest.raises(F.ParseError):
        F.parse_fabric_record("[1]")


def test_the_node_facts_probe_reads_the_document_setup_wrote_for_this_cluster_only(tmp_path: Path) -> None:
    """node_facts.sh (the real sh) reads <root>/etc/sparkctl/<cluster>/fabric.json; another cluster's is not read."""
    doc = tmp_path / "root/etc/sparkctl/t/fabric.json"
    doc.parent.mkdir(parents=True)
    doc.write_text(json.dumps(DOC))
    probe = Path(F.__file__).resolve().parent.parent / "probes/node_facts.sh"

    def record(cluster: str) -> Any:
        env = dict(os.environ, SPARKCTL_SETUP_ROOT=str(tmp_path / "root"), DOCKER_HOST=f"unix://{tmp_path}/none.sock")
        args = F.probe_args(cluster=cluster, docker=False, banner=False, listening=False)
        out = subprocess.run(["sh", "-s", "--", "0123456789abcdef", *args], input=probe.read_bytes(),
                             capture_output=True, env=env, timeout=60, cwd=tmp_path).stdout.decode()
        return F.node_facts_from_probe(out, "0123456789abcdef", expect_docker=False, expect_banner=False,
                                       expect_listening=False, expect_model=False).fabric_record

    assert record("t") == DOC
    assert record("other") is None


def test_check_fails_the_fabric_row_where_a_recorded_port_was_readdressed_and_only_there() -> None:
    from dataclasses import replace

    from sparkctl.rules import check_rules as C
    from tests.unit.rules.test_check_rules import _fabric_facts, needs

    doc = {"ports": {n: {"enp1s0f0np0": {"address": f"10.232.0.1{i}/24", "peers": ["x:y"]}}
                     for i, n in enumerate(("spark1", "spark2"), start=1)}}
    good = replace(_fabric_facts("10.232.0.11"), fabric_record=doc)
    moved = replace(_fabric_facts("10.232.0.99"), fabric_record=doc)  # still in FABRIC_SUBNET: discovery is happy
    findings, _ = C.evaluate(["spark1", "spark2"], needs(), {"spark1": (good, None), "spark2": (moved, None)}, {},
                             lambda f: (None, "-"), None)
    by = {(f.node, f.check): f for f in findings}
    assert by[("spark1", "fabric")].status != FAIL
    assert by[("spark2", "fabric")].status == FAIL
    assert "port enp1s0f0np0 has address 10.232.0.99/24, not 10.232.0.12/24" in by[("spark2", "fabric")].reason


def test_check_names_setup_for_a_port_down_even_when_discovery_failed_on_it_too() -> None:
    """The fabric row: where the node disagrees with setup's document, its finding (the port, the cable, and
    `sparkctl setup` as the fix) is the row, with what discovery found wrong after it; else discovery's."""
    from sparkctl.rules.check_rules import OK, Finding, with_fabric_record

    recorded = rule_fabric_record("s1", facts(DOC, up=False))
    assert recorded is not None
    down = Finding("s1", "fabric", FAIL, "p0 down", "s1: fabric netdev p0 (192.168.100.1/30) is DOWN",
                   "bring it up on s1 (`ip link set p0 up`)")
    row = with_fabric_record(down, recorded)
    assert "`sparkctl setup`" in row.fix and "is down" in row.reason and "is DOWN" in row.reason
    fine = Finding("s1", "fabric", OK, "p0", "s1: p0", "")
    assert with_fabric_record(fine, None) is fine and with_fabric_record(down, None) is down
    assert with_fabric_record(fine, recorded) is recorded
