"""Cleanup touches only what carries this cluster's labels.

On each of the four lab hosts this plants what sparkctl must never touch: a running container of
someone else, a running and a stopped container that look like sparkctl's but belong to another cluster
(`sparkctl.cluster=othercluster`, same naming scheme), two foreign images (one carrying sparkctl-like
image labels), and three user tags beside the chain's own hash tags (`<chain tag>-known-good-…`,
`-backup-…` and a hash-shaped `-0123456789ab`, on the old base image). Then every command that touches
nodes runs — check, build, up, wait, status, logs, audit, lock, down, `lab status` (never `lab down`) —
and each planted thing must still be there, unchanged (same ID; the running ones still running). Everything planted is removed in `finally`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from sparkctl.lab.state import BASE_IMAGE
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
CLUSTER = {"CLUSTER_NAME": "foreign", "PORT": "18903", "MASTER_PORT": "39513"}
TAG = uuid.uuid4().hex[:8]
CHAIN_KEYS3 = "sparkctl-lab/chain:keys3"  # the lab recipe's top chain tag (tag_prefix:layer)


def sk(lab: Lab, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**lab.env(), "NODES": " ".join(NODES), **CLUSTER}
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def plant(lab: Lab, node: str, rank: int) -> dict[str, str]:
    """The foreign things on one host: name -> ID."""
    def ok(r: subprocess.CompletedProcess[str]) -> str:
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    ids = {}
    ids[f"foreign-app-{TAG}"] = ok(lab.docker(node, "run", "-d", "--name", f"foreign-app-{TAG}", "--label", "app=other",
                                              BASE_IMAGE, "sleep", "900"))
    other = f"sparkctl-othercluster-rank{rank}"
    ids[f"{other}-{TAG}"] = ok(lab.docker(
        node, "run", "-d", "--name", f"{other}-{TAG}", "--label", "sparkctl.cluster=othercluster",
        "--label", f"sparkctl.rank={rank}", "--label", "sparkctl.config-hash=0000", BASE_IMAGE, "sleep", "900"))
    ids[f"{other}-stopped-{TAG}"] = ok(lab.docker(
        node, "create", "--name", f"{other}-stopped-{TAG}", "--label", "sparkctl.cluster=othercluster",
        "--label", f"sparkctl.rank={rank}", BASE_IMAGE, "true"))
    ids[f"foreign/plain:{TAG}"] = ok(lab.docker(node, "commit", f"foreign-app-{TAG}", f"foreign/plain:{TAG}"))
    ids[f"foreign/lookalike:{TAG}"] = ok(lab.docker(
        node, "commit", "--change", "LABEL sparkctl.recipe=lab", "--change", "LABEL sparkctl.layer=keys3",
        f"foreign-app-{TAG}", f"foreign/lookalike:{TAG}"))
    # A user's own tags beside the chain's hash tags (`<tag>-<hash12>`), on an image older than every build:
    # retention's sweep of keys3's hash tags must leave them, the hash-shaped one too.
    for suffix in ("known-good", "backup", "0123456789ab"):
        ref = f"{CHAIN_KEYS3}-{suffix}-{TAG}" if suffix != "0123456789ab" else f"{CHAIN_KEYS3}-{suffix}"
        ok(lab.docker(node, "tag", BASE_IMAGE, ref))
        ids[ref] = ok(lab.docker(node, "image", "inspect", "--format", "{{.Id}}", ref))
    return ids


def inventory(lab: Lab, node: str, names: list[str]) -> dict[str, tuple[str, bool | None]]:
    """name -> (ID, running?) for each planted container or image still there."""
    out: dict[str, tuple[str, bool | None]] = {}
    for name in names:
        r = lab.docker(node, "inspect", name)
        if r.returncode != 0:
            continue
        doc = json.loads(r.stdout)[0]
        state = doc.get("State")
        out[name] = (doc["Id"], state["Running"] if isinstance(state, dict) else None)
    return out


@pytest.fixture
def planted(chain: Lab) -> Iterator[tuple[Lab, dict[str, dict[str, str]]]]:
    lab = chain
    sk(lab, "down", timeout=60)
    ids: dict[str, dict[str, str]] = {}
    try:
        for rank, node in enumerate(NODES):
            ids[node] = plant(lab, node, rank)
        yield lab, ids
    finally:
        sk(lab, "lock", "--force-unlock", timeout=30)
        sk(lab, "down", timeout=60)
        for node in NODES:
            names = list(ids.get(node, {}))
            lab.docker(node, "rm", "-f", *[n for n in names if "/" not in n] or ["-"], timeout=60)
            lab.docker(node, "rmi", *[n for n in names if "/" in n] or ["-"], timeout=60)


def test_foreign_containers_and_images_survive_every_command(planted: tuple[Lab, dict[str, dict[str, str]]]) -> None:
    lab, ids = planted
    before = {node: inventory(lab, node, list(ids[node])) for node in NODES}
    assert all(len(before[n]) == 8 for n in NODES)

    results = {}
    for args in (("check",), ("build", "--no-cache"), ("up",), ("wait", "--timeout", "60"), ("status",), ("logs", "--tail", "5"),
                 ("audit",), ("lock", "status"), ("up", "--recreate"), ("down",), ("down",), ("lab", "status")):
        r = sk(lab, *args)
        results[args] = r
        assert "Traceback" not in r.stderr, f"{args}: {r.stderr}"
        assert r.returncode == 0, f"sparkctl {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        after = {node: inventory(lab, node, list(ids[node])) for node in NODES}
        assert after == before, f"`sparkctl {' '.join(args)}` changed a foreign container or image"
    # build really built (every layer on every rank, then its retention sweep): not a no-op that skips
    assert results[("build", "--no-cache")].stdout.count("built dcp mul1 v145 keys keys3") == 4, \
        results[("build", "--no-cache")].stdout
    # The service itself came and went: only this cluster's containers.
    assert "4 ranks started" in results[("up",)].stdout
    for node in NODES:
        left = lab.docker(node, "ps", "-aq", "--filter", "label=sparkctl.cluster=foreign").stdout.split()
        assert left == []
