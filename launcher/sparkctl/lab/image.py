"""The lab's images, built without any registry.

base   sparkctl-lab/base:bookworm  `debootstrap --variant=minbase bookworm` + python3 and iproute2 from
       the Debian mirror apt already uses, tarred once into /var/cache/sparkctl-lab and `docker import`ed
       into every host's engine (~200 MB: later benchmarks need a base of at least 100 MB).
engine sparkctl-lab/engine:latest  FROM base, the stand-in engine as /usr/local/bin/vllm and
       ENTRYPOINT ["vllm", "serve"] like vLLM's OpenAI image (classic builder; there is no buildx here).
       Labelled with the stand-in's hash so a changed stand-in is rebuilt. The chain on top of it is
       the lab checkpoint's own serving/Dockerfile.*, built by `sparkctl build` as in production.

Both are made once, on the first host that needs them, then `docker save`d into the cache and
`docker load`ed into every other engine: every host holds the very same image IDs, as a real cluster
does after `sparkctl build --ship` (an import or a build per host would give each its own ID).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CheckFailed
from . import engines
from .hosts import docker_cli, has_image
from .proc import run, say
from .state import BASE_IMAGE, CACHE_DIR, ENGINE_IMAGE, HostPaths

HERE = Path(__file__).resolve().parent
BASE_TARBALL = CACHE_DIR / "base-bookworm.tar"
PACKAGES = ["python3", "iproute2", "procps", "ca-certificates"]
MIN_BASE_BYTES = 100 * 10**6
STANDIN_LABEL = "org.sparkctl.lab.standin-sha256"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def debian_mirror() -> str:
    """The Debian mirror apt is configured with (deb822 `URIs:` or one-line `deb URL bookworm ...`)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            if uris and re.search(r"^Suites:.*\bbookworm\b(?!-)", stanza, re.M) and "security" not in uris.group(1):
                return uris.group(1).rstrip("/")
        for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
            return m.group(1).rstrip("/")
    return DEFAULT_MIRROR


def ensure_base_tarball() -> Path:
    """Build the base root file system once (about a minute); later calls return the cached tarball."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two `lab up`s at once build it once
        if BASE_TARBALL.exists():
            return BASE_TARBALL
        rootfs = CACHE_DIR / "rootfs.tmp"
        if rootfs.exists():
            shutil.rmtree(rootfs)
        mirror = debian_mirror()
        say(f"lab: building the base image with debootstrap from {mirror} (once; cached in {CACHE_DIR})")
        run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", "bookworm", str(rootfs), mirror],
            timeout=900, where="lab base image")
        # Drop what an image never needs: downloaded .debs, apt lists, docs (~100 MB).
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            target = rootfs / sub
            if target.is_dir():
                for child in target.iterdir():
                    if child.is_file() or child.is_symlink():
                        child.unlink()
                    elif child.is_dir() and child.name != "partial":
                        shutil.rmtree(child)
        tmp = BASE_TARBALL.with_suffix(".tar.tmp")
        run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tmp), "."], timeout=300, where="lab base image")
        shutil.rmtree(rootfs)
        if tmp.stat().st_size < MIN_BASE_BYTES:
            tmp.unlink()
            raise CheckFailed(f"lab base image is smaller than {MIN_BASE_BYTES} bytes; debootstrap went wrong")
        tmp.rename(BASE_TARBALL)
        return BASE_TARBALL


def purge_cache() -> None:
    if CACHE_DIR.exists():
        shutil.rmtree(CACHE_DIR)


FLAGS_FILE = HERE.parent / "data" / "vllm-serve-flags.json"  # the stand-in's flags, from vLLM's parser
STANDIN_FLAGS_PATH = "/usr/local/share/sparkctl-standin/vllm-serve-flags.json"


# The lab's engine image is the stand-in for the production base (Mia's image, built on vLLM's OpenAI
# image): `vllm serve` is its ENTRYPOINT as in vLLM's docker/Dockerfile (target vllm-openai), so a
# `docker run IMAGE vllm serve ...` that forgets --entrypoint fails here as it would there; and it has
# exllamav3 0.0.43 installed (metadata and module only), which the checkpoint's v145 layer replaces.
ENGINE_DOCKERFILE = (
    "ARG BASE\n"
    "FROM ${BASE}\n"
    "COPY standin_vllm.py /usr/local/bin/vllm\n"
    f"COPY vllm-serve-flags.json {STANDIN_FLAGS_PATH}\n"
    "RUN chmod 0755 /usr/local/bin/vllm && /usr/local/bin/vllm --version && "
    "site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') && "
    "mkdir -p \"$site/exllamav3\" \"$site/exllamav3-0.0.43.dist-info\" && "
    "printf '__version__ = \"0.0.43\"\\nUSE_AVX = True\\nCODEBOOKS = (\"mcg\",)\\n' > \"$site/exllamav3/__init__.py\" && "
    "printf 'Metadata-Version: 2.1\\nName: exllamav3\\nVersion: 0.0.43\\n' > \"$site/exllamav3-0.0.43.dist-info/METADATA\" && "
    "python3 -c 'import importlib.metadata as m; assert m.version(\"exllamav3\") == \"0.0.43\"'\n"
    'ENTRYPOINT ["vllm", "serve"]\n'
    "CMD []\n"
)


def standin_sha() -> str:
    """Names the engine image's content: the stand-in and the Dockerfile around it."""
    return hashlib.sha256((HERE / "standin_vllm.py").read_bytes() + FLAGS_FILE.read_bytes()
                          + ENGINE_DOCKERFILE.encode()).hexdigest()


def ensure_base(paths: HostPaths, tarball: Path) -> None:
    if not has_image(paths, BASE_IMAGE):
        docker_cli(paths, "import", "--change", 'CMD ["/bin/bash"]', "--message", "sparkctl lab base (debootstrap)",
                   str(tarball), BASE_IMAGE, timeout=300)


def engine_current(paths: HostPaths) -> bool:
    """The engine image is there and built from today's stand-in (a missing image has no label)."""
    return engines.image_label(paths, ENGINE_IMAGE, STANDIN_LABEL) == standin_sha()


def ensure_engine(paths: HostPaths) -> None:
    """FROM the base, the stand-in as /usr/local/bin/vllm; rebuilt when the stand-in changed."""
    if engine_current(paths):
        return
    with tempfile.TemporaryDirectory(prefix="sparkctl-lab-engine-") as ctx:
        shutil.copyfile(HERE / "standin_vllm.py", Path(ctx) / "standin_vllm.py")
        shutil.copyfile(FLAGS_FILE, Path(ctx) / "vllm-serve-flags.json")
        (Path(ctx) / "Dockerfile").write_text(ENGINE_DOCKERFILE + f"LABEL {STANDIN_LABEL}={standin_sha()}\n")
        run(["docker", "-H", paths.docker_host, "build", "-q", "--build-arg", f"BASE={BASE_IMAGE}",
             "-t", ENGINE_IMAGE, ctx], timeout=300, where=paths.root.name,
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "DOCKER_BUILDKIT": "0"})


def _images_tarball_path() -> Path:
    return CACHE_DIR / f"lab-images-{standin_sha()[:16]}.tar"


def _image_ids(paths: HostPaths) -> dict[str, str]:
    ids = {}
    for ref in (BASE_IMAGE, ENGINE_IMAGE):
        ids[ref] = engines.image_id(paths, ref)
    return ids


def images_tarball(builder: HostPaths, rootfs_tarball: Path) -> tuple[Path, dict[str, str]]:
    """base + engine saved once (built on `builder`'s engine); returns the tarball and its image IDs."""
    tar = _images_tarball_path()
    ids_file = tar.with_suffix(".ids.json")
    with open(CACHE_DIR / ".images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # hosts come up in parallel: one builds, the others wait
        if tar.exists() and ids_file.exists():
            return tar, json.loads(ids_file.read_text())
        ensure_base(builder, rootfs_tarball)
        ensure_engine(builder)
        tmp = tar.with_suffix(".tmp")
        run(["docker", "-H", builder.docker_host, "save", "-o", str(tmp), BASE_IMAGE, ENGINE_IMAGE],
            timeout=300, where=builder.root.name)
        ids = _image_ids(builder)
        os.replace(tmp, tar)
        ids_file.write_text(json.dumps(ids))
        for old in CACHE_DIR.glob("lab-images-*.tar"):  # a stand-in that changed leaves an old one
            if old != tar:
                old.unlink(missing_ok=True)
                old.with_suffix(".ids.json").unlink(missing_ok=True)
        return tar, ids


def ensure_images(paths: HostPaths, rootfs_tarball: Path) -> None:
    """The lab's base and engine images on this host, with the same IDs as on every other host."""
    tar, ids = images_tarball(paths, rootfs_tarball)
    if _image_ids(paths) != ids:
        docker_cli(paths, "load", "-q", "-i", str(tar), timeout=300)


# ------------------------------------------------------------------ one saved image, loaded where missing
def cached_tarball(builder: HostPaths, ref: str, label: str, key: str, stem: str,
                   build: Callable[[], None], save_timeout: float) -> Path:
    """`ref` saved as CACHE_DIR/<stem>-<key>.tar, built on `builder` first (by `build`) unless its engine
    already holds `ref` labelled `label`=`key`. One flock per stem: concurrent `lab up`s build it once.
    A new key leaves the old tarballs behind; they are removed."""
    tar = CACHE_DIR / f"{stem}-{key}.tar"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f".{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tar.exists():
            return tar
        if engines.image_label(builder, ref, label) != key:
            build()
        tmp = tar.with_suffix(".tmp")
        run(["docker", "-H", builder.docker_host, "save", "-o", str(tmp), ref], timeout=save_timeout,
            where=builder.root.name)
        os.replace(tmp, tar)
        for old in CACHE_DIR.glob(f"{stem}-*.tar"):
            if old != tar:
                old.unlink(missing_ok=True)
        return tar


def load_where_missing(hosts: list[HostPaths], ref: str, label: str, key: str, tar: Path,
                       load_timeout: float) -> dict[str, float]:
    """`ref` on every host whose engine lacks it or holds another key, loaded from `tar` two hosts at a
    time (each load writes the whole image; two at once is this 2-CPU machine's pace): seconds per host."""
    def one(paths: HostPaths) -> float:
        t0 = time.monotonic()
        if not has_image(paths, ref) or engines.image_label(paths, ref, label) != key:
            docker_cli(paths, "load", "-q", "-i", str(tar), timeout=load_timeout)
        return time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=2) as pool:
        took = list(pool.map(one, hosts))
    return {p.root.name: t for p, t in zip(hosts, took, strict=True)}
