"""The lab hosts' Docker engines as this machine sees them: through the Docker SDK, on each engine's
own unix socket (HostPaths.docker_host).

This is what the SDK does best: structured answers from a local engine's API (image IDs, labels,
layers, the engine's data root, its containers) with no `--format` templates to parse and no
process per question. Streaming a large tarball in or out (`docker load -i`, `docker save -o`) and
builds stay with the CLI, which streams from and to a file; the SDK's `images.load` would hold the
whole archive in memory. sparkctl itself never uses the SDK for the cluster's nodes: it reaches their
engines over its own verified SSH connection (the SDK's ssh:// transport ignores sparkctl's ssh
config and host-key policy), see docs/dependencies.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import docker
from docker.errors import DockerException, ImageNotFound

from .state import HostPaths

TIMEOUT_S = 30


@contextmanager
def engine(paths: HostPaths, timeout: float = TIMEOUT_S) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=paths.docker_host, timeout=int(timeout))
    try:
        yield client
    finally:
        client.close()


def image_attrs(paths: HostPaths, ref: str) -> dict[str, Any] | None:
    """`docker image inspect REF` as a dict; None when the engine has no such image."""
    with engine(paths) as client:
        try:
            return dict(client.images.get(ref).attrs)
        except ImageNotFound:
            return None


def image_id(paths: HostPaths, ref: str) -> str:
    attrs = image_attrs(paths, ref)
    return str(attrs["Id"]) if attrs else ""


def image_label(paths: HostPaths, ref: str, key: str) -> str:
    attrs = image_attrs(paths, ref)
    labels = ((attrs or {}).get("Config") or {}).get("Labels") or {}
    return str(labels.get(key, ""))


def image_layers(paths: HostPaths, ref: str) -> list[str] | None:
    attrs = image_attrs(paths, ref)
    return list(attrs["RootFS"]["Layers"]) if attrs else None


def data_root(paths: HostPaths) -> str | None:
    """The engine's DockerRootDir; None when it does not answer."""
    try:
        with engine(paths, timeout=15) as client:
            return str(client.info()["DockerRootDir"])
    except (DockerException, OSError, KeyError):
        return None


def remove_all_containers(paths: HostPaths) -> int:
    """Force-remove every container of this engine (the lab's own hosts only); how many there were."""
    with engine(paths, timeout=60) as client:
        found = client.containers.list(all=True)
        for c in found:
            c.remove(force=True)
        return len(found)
