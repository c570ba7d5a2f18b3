"""`sparkctl diagnose` on local nodes (tests/unit/localnodes.py: the probe, check, status, lock, history
and audit really run): one .tar.gz whose manifest names every file, its source and size; no secret planted
in any source (env file, container env, argv, a log line, the audit) reaches it; a node that does not
answer is named, its files missing with why; the service down still gives a bundle."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import NodeError
from tests.conftest import run_cli as run
from tests.unit.localnodes import served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
ENV = {"SERVED_MODEL_NAME": "lab-model"}
SECRETS = {
    "env file": "hf_PlantedEnvFileToken0123456789",
    "api key": "PlantedApiKeyValue-7f3a9c",
    "container env": "PlantedContainerEnvSecret99",
    "argv": "sk-PlantedArgvSecretKey0123456789",
    "log": "hf_PlantedLogLineToken9876543210",
    "log bearer": "eyPlantedBearerToken.abcdefghij",
    "audit": "PlantedAuditPassword42",
}


def _extract(archive: Path, dest: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()}


def _plant(nodes: Any, root: Path) -> None:
    """Secrets in the containers' env and argv (the stub engine's state), a log line, the audit."""
    for n in NODES:
        state_file = root / f"docker-{n}.json"
        state = json.loads(state_file.read_text())
        for c in state.get("containers", state).values() if isinstance(state, dict) else []:
            if isinstance(c, dict) and "Config" in c:
                c["Config"]["Env"] = [f"HF_TOKEN={SECRETS['container env']}", "NCCL_DEBUG=INFO"]
                c["Args"] = ["--model", "/m", "--api-key", SECRETS["argv"]]
        state_file.write_text(json.dumps(state))
        (root / f"docker-logs-{n}").write_text(
            f"INFO loading with token {SECRETS['log']}\n"
            f"DEBUG header Authorization: Bearer {SECRETS['log bearer']}\n")
        audit = next((nodes.home(n)).rglob("audit.log"), None)
        assert audit is not None, f"no audit log on {n}"
        with audit.open("a") as f:
            f.write(json.dumps({"when": "2026-01-01T00:00:00Z", "who": "x", "action": "note",
                                "detail": f"password={SECRETS['audit']}"}) + "\n")


def test_bundle_has_every_source_and_no_planted_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: Any) -> None:
    env_file = tmp_path / "cluster.env"
    env_file.write_text(f"HF_TOKEN={SECRETS['env file']}\nVLLM_API_KEY={SECRETS['api key']}\n")
    with served_scene(monkeypatch, tmp_path, NODES, ENV) as nodes:
        assert run(["--env-file", str(env_file), "up"], capsys)[0] == 0
        _plant(nodes, nodes.root)
        out = tmp_path / "b.tar.gz"
        code, stdout, err = run(["--env-file", str(env_file), "--json", "diagnose", "--out", str(out)], capsys)
        assert code == 0, err
        manifest = json.loads(stdout)
    files = _extract(out, tmp_path / "x")
    assert json.loads(files["sparkctl-diagnose/manifest.json"])["files"] == manifest["files"]
    present = {f["path"] for f in manifest["files"] if not f.get("missing")}
    for want in ("check.json", "status.json", "lock.json", "history.json", "settings.json", "local/cluster.env",
                 "nodes/spark2/docker-inspect.json", "nodes/spark2/ranks.json", "nodes/spark1/audit.jsonl",
                 "nodes/spark3/kernel.txt", "nodes/spark4/meminfo.txt", "nodes/spark1/fabric.txt",
                 "nodes/spark1/logs/sparkctl-t-rank0.log", "rendered/argv.json", "rendered/env.tp4"):
        assert want in present, (want, [f for f in manifest["files"] if f["path"] == want])
    for f in manifest["files"]:
        assert f["command"] and f["what"] and ("missing" in f or f["bytes"] == len(files[f"sparkctl-diagnose/{f['path']}"]))
    assert manifest["caps"]["file_bytes"] > 0 and manifest["caps"]["archive_bytes"] > 0
    fabric_doc = next(f for f in manifest["files"] if f["path"] == "nodes/spark1/fabric.json")
    assert "sparkctl setup" in fabric_doc["what"] and fabric_doc.get("missing"), fabric_doc  # setup never ran here
    blob = b"\n".join(files.values())
    leaks = [k for k, v in SECRETS.items() if v.encode() in blob]
    assert leaks == [], leaks
    # each source was there, redacted (not merely left out)
    text = lambda p: files[f"sparkctl-diagnose/{p}"].decode()  # noqa: E731
    assert "HF_TOKEN=[REDACTED]" in text("local/cluster.env")
    assert "HF_TOKEN=[REDACTED]" in text("nodes/spark2/docker-inspect.json")
    assert '"--api-key",' in text("nodes/spark2/docker-inspect.json")
    assert "token [REDACTED]" in text("nodes/spark1/logs/sparkctl-t-rank0.log")
    assert "password=[REDACTED]" in text("nodes/spark3/audit.jsonl")
    ranks = json.loads(text("nodes/spark2/ranks.json"))
    assert [r["rank"] for r in ranks] == ["1"] and ranks[0]["status"] == "running"


def test_a_node_down_is_named_and_its_files_missing_with_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: Any) -> None:
    from sparkctl.cluster import fanout

    with served_scene(monkeypatch, tmp_path, NODES, ENV):
        transport = fanout.connect

        def down(target: Any, **kw: Any) -> Any:
            if target.alias == "spark3":
                raise NodeError("spark3", "ssh", "spark3: connection refused", "start sshd")
            return transport(target, **kw)

        monkeypatch.setattr(fanout, "connect", down)
        out = tmp_path / "b.tar.gz"
        code, stdout, err = run(["--json", "diagnose", "--out", str(out), "--no-check"], capsys)
        assert code == 0, err
        manifest = json.loads(stdout)
    assert "connection refused" in manifest["unreachable"]["spark3"]
    gone = {f["path"]: f for f in manifest["files"] if f["node"] == "spark3"}
    assert gone and all(f.get("missing") and "connection refused" in f["why"] for f in gone.values()), gone
    assert not any(f.get("missing") for f in manifest["files"] if f["node"] == "spark2" and "kernel" in f["path"])
    assert any(f["path"] == "check.json" and f["why"].startswith("not asked") for f in manifest["files"])


def test_service_down_still_bundles_and_caps_are_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: Any) -> None:
    with served_scene(monkeypatch, tmp_path, NODES, ENV):
        out = tmp_path / "b.tar.gz"
        code, stdout, err = run(["--json", "diagnose", "--out", str(out), "--no-check", "--file-cap", "1024",
                                 "--archive-cap", "8192"], capsys)
        assert code == 0, err
        manifest = json.loads(stdout)
    files = _extract(out, tmp_path / "x")
    assert sum(len(v) for k, v in files.items() if not k.endswith("manifest.json")) <= 8192
    assert all(len(v) <= 1024 for k, v in files.items() if not k.endswith("manifest.json"))
    assert any(f.get("capped") for f in manifest["files"]), "meminfo alone is over 1 KiB"
    assert any(f.get("missing") and "archive's cap" in f["why"] for f in manifest["files"])
    status = next(f for f in manifest["files"] if f["path"] == "status.json")
    assert not status.get("missing"), status


def test_a_probe_that_runs_out_of_time_keeps_the_sections_it_finished(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path, capsys: Any) -> None:
    """A node whose Docker engine hangs: the probe's deadline passes inside its first docker section; the
    files of the sections before it (kernel, meminfo, the kernel's lines) are in the bundle, and each later one
    is missing with the deadline as why. The node is not called unreachable, and the other nodes are whole."""
    from sparkctl.orchestrate import diagnose as D

    monkeypatch.setattr(D, "PROBE_SLACK_S", 1.0)
    with served_scene(monkeypatch, tmp_path, NODES, ENV) as nodes:
        (nodes.root / "docker-hang-spark2").write_text("4")
        out = tmp_path / "b.tar.gz"
        code, stdout, err = run(["--json", "diagnose", "--out", str(out), "--no-check", "--timeout", "1"], capsys)
        assert code == 0, err
        manifest = json.loads(stdout)
    files = {f["path"]: f for f in manifest["files"]}
    assert manifest["unreachable"] == {}
    for kept in ("kernel.txt", "meminfo.txt", "fabric.txt", "kernel-lines.txt"):
        assert not files[f"nodes/spark2/{kept}"].get("missing"), files[f"nodes/spark2/{kept}"]
    for cut in ("docker-version.txt", "docker-inspect.json", "docker-logs.txt"):
        f = files[f"nodes/spark2/{cut}"]
        assert f.get("missing") and f["why"].startswith("cut short:") and "did not finish within 2s" in f["why"], f
    assert not any(f.get("missing") for p, f in files.items() if p.startswith("nodes/spark3/docker-"))
