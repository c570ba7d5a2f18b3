"""setup's probe output, parsed: the CX7 ports with what `ip -j addr` says of them, the SSH session's interface,
the neighbours each port saw, the managed files' hashes; what cannot be read is a problem, never an exception."""

from __future__ import annotations

import json

from sparkctl.facts import setup_facts as S

NONCE = "0011223344556677"
ADDR = [{"ifname": "eth0", "flags": ["UP", "LOWER_UP"], "operstate": "UP", "mtu": 1500, "address": "aa:bb:cc:00:00:01",
         "addr_info": [{"family": "inet", "local": "10.0.0.5", "prefixlen": 24}]},
        {"ifname": "enp1s0f0np0", "flags": ["UP", "LOWER_UP"], "operstate": "UP", "mtu": 9000,
         "address": "02:00:00:00:01:00", "addr_info": [{"family": "inet", "local": "192.168.100.1", "prefixlen": 30}]},
        {"ifname": "enp1s0f1np1", "flags": ["BROADCAST"], "operstate": "DOWN", "mtu": 1500,
         "address": "02:00:00:00:01:01", "addr_info": []}]


def probe(**sections: tuple[str, int]) -> str:
    return "".join(f"@@sparkctl {NONCE} begin {k.replace('_', '-')}\n{v}\n@@sparkctl {NONCE} end {k.replace('_', '-')} {rc}\n"
                   for k, (v, rc) in sections.items())


def test_a_node_as_the_probe_reports_it() -> None:
    f = S.setup_facts_from_probe(probe(
        user=("spark", 0), uid=("1000", 0), groups=("spark adm", 0), sudo=("", 1), nofile=("1024", 0),
        memlock=("unlimited", 0), machine_id=("ab" * 16, 0),
        ssh_route=('client\t10.0.0.100\n[{"dst": "10.0.0.100", "dev": "eth0"}]', 0),
        infiniband=("hca\trocep1s0f0\nnetdev\trocep1s0f0\tenp1s0f0np0\t200000\nhca\trocep1s0f1\n"
                    "netdev\trocep1s0f1\tenp1s0f1np1\t", 0),
        ip_addr=(json.dumps(ADDR), 0),
        neigh=('@@dev\tenp1s0f0np0\n[{"dst": "fe80::2", "lladdr": "02:00:00:00:02:00"}]\n@@dev\tenp1s0f1np1\n\n', 0),
        earlyoom=("", 1), ctk=("/usr/bin/nvidia-ctk", 0), docker_group=("docker:x:999:", 0),
        files=("/etc/sudoers.d/sparkctl\tabsent\n/etc/default/earlyoom\t" + "a" * 64, 0), fabric_doc=("", 0)), NONCE)
    assert f.problems == []
    assert (f.user, f.uid, f.groups, f.sudo, f.is_root) == ("spark", 1000, ("spark", "adm"), False, False)
    assert f.memlock == S.UNLIMITED and f.nofile == 1024 and f.machine_id == "ab" * 16
    assert (f.client_ip, f.ssh_iface, f.ssh_nets) == ("10.0.0.100", "eth0", ("10.0.0.0/24",))
    assert f.ports == [S.Port("enp1s0f0np0", "rocep1s0f0", "02:00:00:00:01:00", 9000, True, True, 200000,
                              ("192.168.100.1/30",)),
                       S.Port("enp1s0f1np1", "rocep1s0f1", "02:00:00:00:01:01", 1500, False, False, None, ())]
    assert f.neighbours == {"enp1s0f0np0": ("02:00:00:00:02:00",), "enp1s0f1np1": ()}
    assert (f.earlyoom, f.ctk, f.docker_group) == (False, True, True)
    assert f.files == {"/etc/sudoers.d/sparkctl": "absent", "/etc/default/earlyoom": "a" * 64}
    assert f.fabric_doc is None


def test_what_cannot_be_read_is_a_problem_naming_it() -> None:
    f = S.setup_facts_from_probe(probe(machine_id=("not-an-id", 0), nofile=("", 2),
                                       infiniband=("netdev\t$(x)\tenp\t1", 0), ip_addr=("[]", 0)), NONCE)
    said = " | ".join(f.problems)
    assert "/etc/machine-id" in said and "ulimit -Hn: exit 2" in said and "CX7 ports" in said
    assert "the SSH session's route: not reported" in said
    assert S.setup_facts_from_probe("garbage", "x").problems  # a bad nonce: one problem, no exception


def test_only_neighbours_that_answered_the_ping_count() -> None:
    """A neighbour entry whose host did not answer now (a cable since moved: its entry stays STALE for minutes)
    is not a cable; iputils' `fe80::…%dev:` and the older `fe80::…:` both name a replier. Without a ping
    section (no ping on the node) every entry counts."""
    table = json.dumps([{"dst": "fe80::2", "lladdr": "02:00:00:00:02:00", "state": ["STALE"]},
                        {"dst": "fe80::3", "lladdr": "02:00:00:00:03:00", "state": ["STALE"]},
                        {"dst": "fe80::4", "lladdr": "02:00:00:00:04:00", "state": ["STALE"]}])
    text = (f"@@dev\tenp1s0f0np0\n{table}\n@@replied\nbytes from fe80::2%enp1s0f0np0:\nbytes from fe80:0::4:\n"
            f"@@dev\tenp1s0f1np1\n{table}\n@@replied\n"
            f"@@dev\tenp2s0f0np0\n{table}\n")
    assert S.parse_neighbours(text) == {"enp1s0f0np0": ("02:00:00:00:02:00", "02:00:00:00:04:00"),
                                        "enp1s0f1np1": (),
                                        "enp2s0f0np0": ("02:00:00:00:02:00", "02:00:00:00:03:00", "02:00:00:00:04:00")}
