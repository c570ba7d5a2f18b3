"""Host keys are judged per host (cluster/hostkeys.py), without sshd: the verdict for one host reads only
the known_hosts entries whose names match it. test_cluster.py proves the same against real sshd."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from sparkctl.cluster import hostkeys
from sparkctl.cluster.sshconfig import SshTarget

KEY_A, KEY_B = os.urandom(51), os.urandom(51)  # stand-ins for two hosts' ed25519 key blobs


def _line(name: str, blob: bytes, key_type: str = "ssh-ed25519") -> str:
    return f"{name} {key_type} {base64.b64encode(blob).decode()}\n"


def _target(known: Path, hostname: str, port: int = 22) -> SshTarget:
    return SshTarget(alias=hostname, hostname=hostname, port=port, user="root", identity_files=(),
                     identities_only=False, known_hosts_files=(str(known),), global_known_hosts_files=())


@pytest.mark.parametrize("listed_as", ["hostb", "[hostb]:2222", "HASHED", "hostb,10.0.0.2", "hos?b", "*b"])
def test_a_key_listed_only_for_another_host_is_unknown(tmp_path: Path, listed_as: str) -> None:
    known = tmp_path / "known_hosts"
    name = hostkeys.hash_hostname("hostb") if listed_as == "HASHED" else listed_as
    # hosta's own key, but listed under hostb's name only; hostb's entry is the only one in the file
    known.write_text(_line(name, KEY_A))
    verdict = hostkeys.judge_host_key(_target(known, "hosta"), "ssh-ed25519", KEY_A)
    assert verdict.status == "unknown" and verdict.known == ()
    assert hostkeys.host_key_error(_target(known, "hosta"), verdict).kind == "hostkey-unknown"
    # the host it is listed for is trusted with it (the file is read, the names compared)
    hostb = _target(known, "hostb", 2222 if "2222" in listed_as else 22)
    assert hostkeys.judge_host_key(hostb, "ssh-ed25519", KEY_A).status == "trusted"


def test_another_hosts_key_beside_this_hosts_own_is_changed_not_trusted(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(_line("hosta", KEY_A) + _line("hostb", KEY_B))
    # hosta offers hostb's key: known_hosts has another ed25519 key for hosta -> changed, loudly
    verdict = hostkeys.judge_host_key(_target(known, "hosta"), "ssh-ed25519", KEY_B)
    assert verdict.status == "changed" and [e.key_blob for e in verdict.known] == [KEY_A]
    assert hostkeys.judge_host_key(_target(known, "hosta"), "ssh-ed25519", KEY_A).status == "trusted"
