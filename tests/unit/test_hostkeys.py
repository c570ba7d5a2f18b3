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


# What `bench/mutation.py hostkeys` showed untested (docs/mutations.md keeps the runs). Fixed blobs: the
# order of two random ones decided whether a `==` -> `>=` break was seen.
LOW, HIGH = b"\x01" * 51, b"\xfe" * 51


@pytest.mark.parametrize(("offered", "known"), [(LOW, HIGH), (HIGH, LOW)])
def test_only_the_exact_key_is_trusted_whichever_way_the_blobs_sort(tmp_path: Path, offered: bytes,
                                                                    known: bytes) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(_line("hosta", known))
    assert hostkeys.judge_host_key(_target(path, "hosta"), "ssh-ed25519", offered).status == "changed"
    assert hostkeys.judge_host_key(_target(path, "hosta"), "ssh-ed25519", known).status == "trusted"


@pytest.mark.parametrize(("pattern", "name", "hit"), [
    ("10.0.0.?", "10.0.0.7", True), ("10.0.0.*", "10.0.0.17", True), ("n?.lab", "n1.lab", True),
    # every other character is itself: '.', digits and '-' sort below '?' and are still literal
    ("10.0.0.1?", "19.0.0.12", False), ("10.0.0.1?", "10a0b0c12", False), ("a-b?", "a.bc", False),
])
def test_a_wildcard_stands_only_for_itself(pattern: str, name: str, hit: bool) -> None:
    assert hostkeys.host_matches([pattern], name) is hit


def test_an_entry_with_a_comment_is_read_and_a_short_line_skipped(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text("hostb ssh-ed25519\n" + _line("hosta", HIGH).rstrip("\n") + " root@hosta\n")
    assert hostkeys.judge_host_key(_target(path, "hosta"), "ssh-ed25519", HIGH).status == "trusted"
    assert [e.patterns for e in hostkeys.read_known_hosts([str(path)])] == [("hosta",)]


def test_a_file_gone_between_stat_and_open_is_empty() -> None:
    assert hostkeys._parse_known_hosts("/nonexistent/known_hosts", (0, 0, 0)) == ()


def test_trust_replaces_only_this_hosts_key_of_that_type(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    keep = ["# a comment", "hostb ssh-ed25519",                       # a comment, a line too short to be an entry
            _line("hosta", LOW, "ssh-rsa").rstrip("\n"),              # hosta's key of another type
            _line("hostb", LOW).rstrip("\n") + " root@hostb",         # another host's key of that type
            "@cert-authority hosta " + _line("x", LOW).split(" ", 1)[1].rstrip("\n")]
    old = [_line("hosta", LOW).rstrip("\n"), _line("hosta,10.0.0.1", LOW).rstrip("\n") + " old@hosta"]
    path.write_text("\n".join([keep[0], old[0], *keep[1:], old[1]]) + "\n")
    assert hostkeys.record_host_key(_target(path, "hosta"), "ssh-ed25519", HIGH) == str(path)
    assert path.read_text().splitlines() == [*keep, _line("hosta", HIGH).rstrip("\n")]


def test_a_key_marked_revoked_is_revoked_even_beside_a_trusting_line(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(_line("hosta", HIGH) + "@revoked * " + _line("x", HIGH).split(" ", 1)[1])
    verdict = hostkeys.judge_host_key(_target(path, "hosta"), "ssh-ed25519", HIGH)
    assert verdict.status == "revoked"
    assert hostkeys.host_key_error(_target(path, "hosta"), verdict).kind == "hostkey-revoked"
    assert hostkeys.judge_host_key(_target(path, "hosta"), "ssh-ed25519", LOW).status == "changed"


def test_a_line_that_is_not_base64_is_skipped_and_the_lines_after_it_still_read(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text("hostb ssh-ed25519 not*base64\n" + _line("hosta", HIGH))
    assert hostkeys.judge_host_key(_target(path, "hosta"), "ssh-ed25519", HIGH).status == "trusted"


def test_trust_writes_through_a_symlink_keeping_every_other_byte_and_the_mode(tmp_path: Path) -> None:
    """A known_hosts that is a symlink (dotfiles) stays one: its target is rewritten. Lines that are not UTF-8,
    with CRLF or with a form feed, survive byte for byte; the file's mode stays."""
    real = tmp_path / "dotfiles" / "known_hosts"
    real.parent.mkdir()
    other = [b"# caf\xe9 (latin-1)", b"hostb ssh-ed25519 " + base64.b64encode(LOW) + b" x\r", b"\x0c# form feed \x1c"]
    real.write_bytes(b"\n".join([other[0], _line("hosta", LOW).rstrip("\n").encode(), *other[1:]]))  # no final newline
    real.chmod(0o644)
    link = tmp_path / "known_hosts"
    link.symlink_to(real)
    assert hostkeys.record_host_key(_target(link, "hosta"), "ssh-ed25519", HIGH) == str(real)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == b"\n".join([*other, _line("hosta", HIGH).rstrip("\n").encode()]) + b"\n"
    assert real.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in real.parent.iterdir()) == ["known_hosts"]  # no temporary file left
