"""model pull / model sync, offline: the stand-in Hub against the real huggingface_hub client (the
referee), hf_pull.py as the head runs it, and sync's pure parts (delta plan, refusals, argv)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkctl.checkpoint import sync_plan as modelsync
from sparkctl.errors import CheckFailed
from sparkctl.lab import ckptgen
from sparkctl.lab.hfhub import StandinHub
from sparkctl.orchestrate.model_pull import BOOT
from sparkctl.probes.ckpt_scan import scan
from sparkctl.probes.model_node import describe, mount_of
from sparkctl.spec.resources import probe_script

hf = pytest.importorskip("huggingface_hub")
REPO = "lab/tiny"
TOKEN = "hf_unit_secret_0123456789"


@pytest.fixture()
def pack(tmp_path: Path) -> Path:
    return ckptgen.make_checkpoint(tmp_path / "pack", "tiny")


def _pull(url: str, rev: str, dest: Path, token: str = TOKEN) -> tuple[dict[str, object], str]:
    """hf_pull.py exactly as the head runs it: bootstrap on argv, script then token on stdin."""
    script = probe_script("hf_pull.py")
    env = {"PATH": os.environ.get("PATH", ""), "HF_ENDPOINT": url, "HOME": str(dest.parent),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    r = subprocess.run([sys.executable, "-c", BOOT, str(len(script)), REPO, rev, str(dest)],
                       input=script + token.encode() + b"\n", capture_output=True, env=env, timeout=120)
    out = r.stdout.decode()
    assert out.startswith("@@ready\n"), out + r.stderr.decode()
    return json.loads(out.splitlines()[-1]), r.stderr.decode()


def test_real_client_downloads_from_the_standin_and_moves_only_the_changed_shard(pack: Path, tmp_path: Path) -> None:
    hub = StandinHub(tmp_path / "hub", token=TOKEN)
    rev1 = hub.publish(REPO, pack)
    dest = tmp_path / "dest"
    total = sum(p.stat().st_size for p in pack.rglob("*") if p.is_file())
    with hub.serve() as url:
        doc, err = _pull(url, rev1, dest)
        assert doc["status"] == "downloaded" and doc["commit"] == rev1, (doc, err)
        assert hub.bytes_served == total == doc["downloaded_bytes"] == doc["total_bytes"]
        assert TOKEN not in json.dumps(doc) + err
        got = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() and ".cache" not in p.parts}
        assert got == {p.relative_to(pack).as_posix() for p in pack.rglob("*") if p.is_file()} | {".sparkctl-model.json"}

        # Re-run at the same commit: nothing asked of the Hub at all.
        asked = len(hub.requests)
        doc, _ = _pull(url, rev1, dest)
        assert doc["status"] == "up-to-date" and doc["downloaded_bytes"] == 0
        assert len(hub.requests) == asked  # how fast that is: bench/model_speed.py (target < 2 s)

        # A new revision with one shard changed: the client fetches that shard and nothing else.
        changed = ckptgen.new_revision_of_shard(pack, 2)
        rev2 = hub.publish(REPO, pack)
        assert rev2 != rev1
        before = hub.bytes_served
        doc, _ = _pull(url, rev2, dest)
        assert doc["status"] == "downloaded"
        assert hub.bytes_served - before == changed.stat().st_size == doc["downloaded_bytes"]
        assert (dest / changed.name).read_bytes() == changed.read_bytes()

        # A branch name is resolved to the commit it points at, and recorded.
        doc, _ = _pull(url, "main", dest)
        assert doc["status"] == "up-to-date" and doc["commit"] == rev2


def test_the_marker_is_written_through_a_private_temp_file_never_through_a_planted_link(pack: Path, tmp_path: Path) -> None:
    """Whoever can write MODEL may plant symlinks at the names the marker's temp file once had: the pull
    writes its marker through a file of its own and renames it, so their targets stay as they were."""
    hub = StandinHub(tmp_path / "hub", token=TOKEN)
    rev = hub.publish(REPO, pack)
    dest = tmp_path / "dest"
    dest.mkdir()
    canary = tmp_path / "canary"
    canary.write_bytes(b"the SSH user's file\n")
    planted = [dest / ".sparkctl-model.json.tmp", dest / ".sparkctl-model.json"]
    for p in planted:
        p.symlink_to(canary)
    with hub.serve() as url:
        doc, err = _pull(url, rev, dest)
    assert doc["status"] == "downloaded", (doc, err)
    assert canary.read_bytes() == b"the SSH user's file\n"
    marker = dest / ".sparkctl-model.json"
    assert not marker.is_symlink() and json.loads(marker.read_text())["revision"] == rev
    left = sorted(p.name for p in dest.iterdir() if p.name.startswith(".sparkctl-model"))
    assert left == [".sparkctl-model.json", ".sparkctl-model.json.tmp"]  # the planted link, untouched
    assert (dest / ".sparkctl-model.json.tmp").is_symlink()


def test_wrong_token_is_refused_and_nothing_is_written(pack: Path, tmp_path: Path) -> None:
    hub = StandinHub(tmp_path / "hub", token=TOKEN)
    rev = hub.publish(REPO, pack)
    with hub.serve() as url:
        doc, err = _pull(url, rev, tmp_path / "dest", token="hf_wrong")
    assert doc["status"] == "error" and hub.bytes_served == 0
    assert "hf_wrong" not in json.dumps(doc) + err


def test_no_space_is_refused_before_the_first_byte(pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = StandinHub(tmp_path / "hub")
    rev = hub.publish(REPO, pack)
    # The script's free-space figure, shrunk via its own function (runs in-process here).
    import sparkctl.probes.hf_pull as hp

    monkeypatch.setattr(hp, "free_bytes", lambda path: 1000)
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("\n"))
    out = __import__("io").StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    with hub.serve() as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", url)
        rc = hp.main([REPO, rev, str(tmp_path / "dest")])
    doc = json.loads(out.getvalue().splitlines()[-1])
    assert rc == 1 and doc["status"] == "no-space" and doc["need_bytes"] > 1000
    assert hub.bytes_served == 0 and not (tmp_path / "dest").exists()


# ------------------------------------------------------------------------------------------- sync
def _scan(d: Path) -> dict[str, object]:
    return scan(str(d), headers="none", fingerprints=True)


def test_plan_sends_only_what_differs(pack: Path, tmp_path: Path) -> None:
    copy = ckptgen.copy_pack(pack, tmp_path / "copy")
    src = _scan(pack)
    assert modelsync.plan_files(src, _scan(copy)) == []
    assert modelsync.plan_files(src, None) == sorted(src["files"])  # type: ignore[arg-type]
    changed = ckptgen.new_revision_of_shard(pack, 2)
    src = _scan(pack)
    assert modelsync.plan_files(src, _scan(copy)) == [changed.name]
    # a partial shard (cut short) on the destination is sent again
    ckptgen.truncate_shard(copy, 1, 10)
    assert set(modelsync.plan_files(src, _scan(copy))) == {changed.name, ckptgen.shards(pack)[0].name}
    assert modelsync.plan_bytes(src, [changed.name]) == changed.stat().st_size


def test_plan_sends_files_of_nested_folders(pack: Path, tmp_path: Path) -> None:
    """A checkpoint's serving/ may nest folders (a layer that copies a package): every file in them is
    listed and sent, so `build` on a rank finds what its Dockerfile copies."""
    deep = pack / "serving" / "v145" / "pkg" / "sub"
    deep.mkdir(parents=True)
    (deep / "__init__.py").write_text("x = 1\n")
    src = _scan(pack)
    assert "serving/v145/pkg/sub/__init__.py" in src["files"]
    assert "serving/v145/pkg/sub/__init__.py" in modelsync.plan_files(src, None)


def test_plan_compares_shards_by_header_and_first_last_mib_not_mtime(pack: Path, tmp_path: Path) -> None:
    copy = ckptgen.copy_pack(pack, tmp_path / "copy")
    shard = ckptgen.shards(copy)[0]
    os.utime(shard, (1, 1))  # only the mtime differs: same bytes, nothing to send
    assert modelsync.plan_files(_scan(pack), _scan(copy)) == []


def test_same_folder_is_detected_by_inode_and_ctime(pack: Path, tmp_path: Path) -> None:
    copy = ckptgen.copy_pack(pack, tmp_path / "copy")
    link = tmp_path / "link"
    link.symlink_to(pack)
    assert modelsync.same_folder(describe(str(pack)), describe(str(link)))  # one folder seen twice
    assert not modelsync.same_folder(describe(str(pack)), describe(str(copy)))  # a copy is not
    assert not modelsync.same_folder({"identity": None}, {"identity": None})


def test_describe_reports_free_space_of_the_nearest_existing_folder(tmp_path: Path) -> None:
    d = describe(str(tmp_path / "not" / "yet"))
    st = os.statvfs(tmp_path)
    assert d["exists"] is False and abs(d["free_bytes"] - st.f_bavail * st.f_frsize) < 64 * 2**20


def test_mount_of_picks_the_innermost_and_latest_mount() -> None:
    info = "\n".join([
        "22 1 8:1 / / rw - ext4 /dev/vda rw",
        "40 22 0:50 / /models rw - nfs4 10.0.0.1:/export/models rw",
        "41 40 0:51 / /models/lab rw - ext4 /dev/vdb rw",
        "42 40 0:50 /export/models /models/lab rw - nfs4 10.0.0.1:/export/models rw",
    ])
    assert mount_of("/models/lab/x", info) == {"mountpoint": "/models/lab", "fstype": "nfs4",
                                               "source": "10.0.0.1:/export/models"}
    assert mount_of("/models/other", info)["fstype"] == "nfs4"
    assert mount_of("/srv", info)["fstype"] == "ext4"


def test_rsync_argv_keeps_partials_aside_and_uses_only_its_own_key() -> None:
    argv = modelsync.rsync_argv("/models/m x", "root", "10.232.0.12", "/models/m x", ".sparkctl/c/sync-n2.list",
                                ".sparkctl/c/sync_ed25519", ".sparkctl/c/sync_known_hosts")
    assert argv[:2] == ["rsync", "-a"]
    assert "--ignore-times" in argv and "--partial-dir=.sparkctl-partial" in argv
    assert not any(a.startswith("--inplace") or a == "--append" for a in argv)
    assert argv[-2:] == ["/models/m x/", "root@10.232.0.12:/models/m x/"]
    ssh = shlex.split(argv[argv.index("-e") + 1])
    assert ssh[:3] == ["ssh", "-F", "/dev/null"]
    assert "StrictHostKeyChecking=yes" in ssh and "BatchMode=yes" in ssh
    assert "UserKnownHostsFile=.sparkctl/c/sync_known_hosts" in ssh


def test_authorized_line_is_restricted_to_the_source_address() -> None:
    line = modelsync.authorized_line("ssh-ed25519 AAAAC3Nza+/= sparkctl-sync@c", "10.232.0.11", "sparkctl-sync:c:spark1")
    assert line == 'restrict,from="10.232.0.11" ssh-ed25519 AAAAC3Nza+/= sparkctl-sync:c:spark1'
    with pytest.raises(CheckFailed):
        modelsync.authorized_line("ssh-ed25519 AAA$(touch x)", "10.232.0.11", "t")
    with pytest.raises(CheckFailed):
        modelsync.authorized_line("ssh-ed25519 AAAA", '10.0.0.1",command="sh', "t")


def test_progress_and_stats_are_read_from_real_rsync_output(tmp_path: Path) -> None:
    if not Path("/usr/bin/rsync").exists():
        pytest.skip("rsync is not installed here")
    src, dst = tmp_path / "s", tmp_path / "d"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3_000_000))
    lst = tmp_path / "list"
    lst.write_bytes(modelsync.files_list(["a.bin"]))
    argv = modelsync.rsync_argv(str(src), "x", "127.0.0.1", str(dst), str(lst), "k", "kh")
    local = [a for a in argv[:-2] if a not in ("-e",) and not a.startswith("ssh ")] + [str(src) + "/", str(dst) + "/"]
    r = subprocess.run(local, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert modelsync.parse_progress(r.stdout)[0] == 3_000_000  # type: ignore[index]
    sent = modelsync.parse_sent(r.stdout)
    assert sent is not None and 3_000_000 <= sent <= 1.05 * 3_000_000
    assert (dst / "a.bin").read_bytes() == (src / "a.bin").read_bytes()


def test_lifeline_stops_the_command_when_its_input_closes(tmp_path: Path) -> None:
    """What Ctrl-C relies on: sparkctl going away closes the session's stdin and the copy stops."""
    p = subprocess.Popen(["sh", "-c", modelsync.LIFELINE, "sh", "sleep", "30"], stdin=subprocess.PIPE)
    time.sleep(0.3)
    assert p.poll() is None  # stdin open: it runs
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait(timeout=5) == 143  # SIGTERM


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", ""), "NODES": "n1 n2 n3 n4", "MODEL": "/models/x", "RECIPE": "lab",
            "HOME": "/nonexistent"}
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=60, cwd="/")


def test_pull_without_a_revision_is_bad_input_before_any_connection() -> None:
    r = _cli("model", "pull")
    assert r.returncode == 2 and "MODEL_REVISION" in r.stderr and "Traceback" not in r.stderr
    r = _cli("model", "pull", MODEL_REVISION="main", MODEL_REPO="not a repo")
    assert r.returncode == 2 and "MODEL_REPO" in r.stderr


def test_sync_to_a_node_outside_nodes_is_bad_input() -> None:
    r = _cli("model", "sync", "--to", "elsewhere")
    assert r.returncode == 2 and "elsewhere" in r.stderr and "Traceback" not in r.stderr
