"""The lab's torch image, for `check --fabric` in the lab: sparkctl-lab/torch:latest.

Production runs the fabric test in the chain image itself (it holds vLLM, hence torch and NCCL). The
lab's chain is built over a stand-in engine without torch, and putting the ~700 MB CPU torch into the
lab's base would make every `lab up` -- which other engineers run all day -- load it into every
engine. So torch lives in an image of its own, FROM the engine image plus the local CPU wheel
(/opt/wheels/torch-*+cpu-cp311-*.whl, unpacked; its one import-time need, typing_extensions, beside
it), built once, saved into the lab's cache keyed by the wheel's hash and the engine image's ID, and
loaded into the hosts only when a fabric test asks for it (`sparkctl lab torch`, the lab fixture
`torch_image`, bench/fabric_check.py). The lab recipe's `[fabric] image` names it.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from ..errors import CheckFailed
from . import engines
from .image import cached_tarball, load_where_missing
from .proc import run, say
from .state import BASE_IMAGE, CACHE_DIR, TORCH_IMAGE, HostPaths

KEY_LABEL = "org.sparkctl.lab.torch-key"
WHEEL_GLOB = "/opt/wheels/torch-*+cpu-cp311-*.whl"
SITE = "/usr/local/lib/python3.11/dist-packages"  # on Debian bookworm's python3 path


def find_wheel() -> Path:
    given = os.environ.get("SPARKCTL_LAB_TORCH_WHEEL")
    found = [given] if given else sorted(glob.glob(WHEEL_GLOB))
    if not found or not Path(found[-1]).is_file():
        raise CheckFailed(f"no CPU torch wheel for the lab's python3.11 ({given or WHEEL_GLOB})",
                          fix="put torch-*+cpu-cp311-*.whl in /opt/wheels or set SPARKCTL_LAB_TORCH_WHEEL")
    return Path(found[-1])


def wheel_sha(wheel: Path) -> str:
    """sha256 of the wheel, remembered beside the cache by (size, mtime): hashing 190 MB takes a second."""
    st = wheel.stat()
    memo = CACHE_DIR / "torch-wheel-sha.json"
    stamp = f"{wheel}:{st.st_size}:{st.st_mtime_ns}"
    try:
        doc = json.loads(memo.read_text())
        if doc.get("stamp") == stamp:
            return str(doc["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    memo.write_text(json.dumps({"stamp": stamp, "sha256": h.hexdigest()}))
    return h.hexdigest()


def _label(paths: HostPaths) -> str:
    return engines.image_label(paths, TORCH_IMAGE, KEY_LABEL)


def torch_key(paths: HostPaths, wheel: Path) -> str:
    """The wheel's hash and the base's layers (not its ID: every `lab up` after a stand-in change
    re-imports the same root file system under a new ID, and that must not rebuild 700 MB)."""
    found = engines.image_layers(paths, BASE_IMAGE)
    if found is None:
        raise CheckFailed(f"{paths.root.name}: the lab base image is missing", fix="sparkctl lab up")
    layers = json.dumps(found, separators=(",", ":"))  # as `--format '{{json .RootFS.Layers}}'` printed it
    return hashlib.sha256(f"{wheel_sha(wheel)}\n{layers}".encode()).hexdigest()[:16]


def _typing_extensions() -> Path:
    spec = importlib.util.find_spec("typing_extensions")
    if spec is None or not spec.origin:
        raise CheckFailed("typing_extensions is not installed next to sparkctl (torch needs it at import)",
                          fix="pip install 'typing-extensions>=4.10'")
    return Path(spec.origin)


def _build(paths: HostPaths, wheel: Path, key: str) -> None:
    with tempfile.TemporaryDirectory(prefix="sparkctl-lab-torch-") as ctx:
        site = Path(ctx) / "site"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        shutil.copyfile(_typing_extensions(), site / "typing_extensions.py")
        (Path(ctx) / "Dockerfile").write_text(
            "ARG BASE\n"
            "FROM ${BASE}\n"
            f"COPY site/ {SITE}/\n"
            "RUN python3 -c 'import torch, torch.distributed as d; assert d.is_gloo_available()'\n"
            f"LABEL {KEY_LABEL}={key}\n"
        )
        run(["docker", "-H", paths.docker_host, "build", "-q", "--build-arg", f"BASE={BASE_IMAGE}",
             "-t", TORCH_IMAGE, ctx], timeout=600, where=paths.root.name,
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "DOCKER_BUILDKIT": "0"})


def torch_tarball(builder: HostPaths) -> tuple[Path, str]:
    """The saved torch image (built on `builder` if the cache lacks it) and its key."""
    wheel = find_wheel()
    key = torch_key(builder, wheel)

    def build() -> None:
        say(f"lab: building {TORCH_IMAGE} from {wheel.name} (once; cached in {CACHE_DIR})")
        _build(builder, wheel, key)

    return cached_tarball(builder, TORCH_IMAGE, KEY_LABEL, key, "lab-torch", build, save_timeout=600), key


def ensure_torch(hosts: list[HostPaths]) -> str:
    """TORCH_IMAGE on every given host (loaded from the cache where missing or stale); returns its key."""
    if not hosts:
        raise CheckFailed("no lab hosts", fix="sparkctl lab up")
    tar, key = torch_tarball(hosts[0])
    load_where_missing(hosts, TORCH_IMAGE, KEY_LABEL, key, tar, load_timeout=600)  # 700 MB each
    return key
