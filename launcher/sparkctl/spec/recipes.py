"""Recipes: everything that differs between deployments, as data files (recipes/<name>.toml).

A recipe names the knob defaults, the memory profile, the extra vLLM arguments, the container
options, the image chain (base, ordered layers, payload files per layer) and the checkpoint layout
rules. Loading checks the file's shape and names the file and the key that is wrong.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .resources import recipes_dir
from .vllm_flags import secret_flag_refusal

# A container environment variable's name (POSIX): nothing that could end its line in a rank's env file.
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
VERSION_KEYS = ("vllm", "torch", "exllamav3", "nccl")  # what `build` reads from each image it builds
_PLAIN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# A layer's name is a docker tag (`<tag_prefix>:<name>`) and a folder name (bake's staged context): no `/`, no `..`.
_LAYER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")

DEFAULT_RECIPE = "glm53-exl3-tp4"


@dataclass(frozen=True)
class MemoryProfile:
    overhead_gib: float = 14.0
    os_reserve_gib: float = 4.0
    gpu_memory_utilization_cap: float = 0.82
    kv_block_tokens: int = 64


@dataclass(frozen=True)
class ImageLayer:
    """One layer of the chain: its Dockerfile is `$MODEL/serving/<dockerfile>`, built in `serving/`."""

    name: str
    dockerfile: str
    expect: dict[str, str] = field(default_factory=dict)  # versions the built image must report (vllm, torch, exllamav3, nccl)


@dataclass(frozen=True)
class Prebuilt:
    """The recipe runs a published image (IMAGE) instead of a chain it builds: `build` gives every rank
    the head's copy of it (pulled by digest, or sent layer by layer when it has none)."""

    source: str  # where it is published (named in messages: e.g. the serve recipe's repository)


@dataclass(frozen=True)
class ContainerOptions:
    network: str = "host"
    ipc: str = "host"
    gpus: str = "all"
    devices: tuple[str, ...] = ()
    cap_add: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    mounts: tuple[str, ...] = ()  # host folders bound read-only at the same path (the lab's sysfs tree)


@dataclass(frozen=True)
class FabricTest:
    """`check --fabric`: how the collective runs, and the floor its busbw must reach."""

    backend: str = "nccl"  # nccl (production: GPUs) or gloo (the lab: CPU only)
    image: str = ""  # empty: the chain image that will serve (IMAGE); the lab names its torch image
    sizes: tuple[int, ...] = (1 << 20, 16 << 20, 64 << 20, 256 << 20)
    warmup: int = 2
    iters: int = 5
    timeout_s: float = 60.0
    busbw_floor_gbps: float = 0.0  # 0: no floor
    expect_rdma: bool = True  # a rank on NET/Socket is a failure


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str
    defaults: dict[str, Any]
    memory: MemoryProfile
    vllm_extra_args: tuple[str, ...]
    dspark_speculative_config: str | None
    container: ContainerOptions
    tag_prefix: str
    layers: tuple[ImageLayer, ...]
    layout_name: str
    fabric: FabricTest = FabricTest()
    prebuilt: Prebuilt | None = None  # set: IMAGE is a published image, there is no chain

    @property
    def checkpoint_layout(self) -> dict[str, Any]:
        """The rules `verify-model` applies (recipes/layouts/<layout>.json)."""
        try:
            return load_layout(self.layout_name)
        except ValueError as exc:
            raise UsageError(f"recipe {self.name}: {exc}") from None

    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]


def load_layout(name: str) -> dict[str, Any]:
    """A checkpoint layout, the rules `verify-model` applies (see `verify`'s docstring), by name
    (recipes/layouts/NAME.json) or by path (NAME ending in .json). Raises ValueError with the reason."""
    path = Path(name) if name.endswith(".json") else recipes_dir() / "layouts" / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        known = sorted(p.stem for p in (recipes_dir() / "layouts").glob("*.json"))
        raise ValueError(f"checkpoint layout {name!r} not found (known: {', '.join(known)})") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint layout {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"checkpoint layout {path}: expected a JSON object")
    return data


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.toml"))


def is_recipe_file(name_or_path: str) -> bool:
    """Whether RECIPE names a recipe file (a path) rather than a shipped recipe (a name)."""
    return name_or_path.endswith(".toml") or "/" in name_or_path


def load_recipe(name_or_path: str) -> Recipe:
    """Load a shipped recipe by name, or a recipe file by path."""
    candidate = Path(name_or_path)
    if is_recipe_file(name_or_path):
        path = candidate
    else:
        path = recipes_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(available_recipes())
        raise UsageError(
            f"RECIPE={name_or_path!r}: no such recipe", fix=f"use one of: {known}, or a path to a .toml recipe file"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"recipe {path}: not valid TOML ({exc})") from None
    check_shape(data, path)
    return _parse(data, path)


def check_shape(data: dict[str, Any], path: Path) -> None:
    """The recipe's shape against its JSON Schema (recipe_schema.py): the first problem as one UsageError
    line naming the file, the key and what is expected."""
    from .recipe_schema import first_problem, recipe_schema

    found = first_problem(recipe_schema(), data)
    if found:
        pointer, problem = found
        raise UsageError(f"recipe {path}{pointer}: {problem}",
                         fix="every key and its type: docs/recipes.md and data/recipe.schema.json")


def _get(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if key not in data:
        if default is ...:
            raise UsageError(f"{where}/{key}: missing")
        return default
    value = data[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise UsageError(f"{where}/{key}: should be a {names}, got {value!r}")
    return value


def _str_list(data: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = _get(data, key, list, where, [])
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise UsageError(f"{where}/{key}/{i}: should be a string, got {item!r}")
    return tuple(value)


def _parse(data: dict[str, Any], path: Path) -> Recipe:
    where = str(path)
    known_top = {"name", "description", "defaults", "memory", "vllm", "container", "images", "checkpoint", "fabric"}
    for key in data:
        if key not in known_top:
            raise UsageError(f"{where}/{key}: unknown section", fix=f"known: {', '.join(sorted(known_top))}")
    name = _get(data, "name", str, where)
    defaults = _get(data, "defaults", dict, where)

    mem = _get(data, "memory", dict, where, {})
    memory = MemoryProfile(
        overhead_gib=float(_get(mem, "overhead_gib", (int, float), f"{where}/memory", 14)),
        os_reserve_gib=float(_get(mem, "os_reserve_gib", (int, float), f"{where}/memory", 4)),
        gpu_memory_utilization_cap=float(
            _get(mem, "gpu_memory_utilization_cap", (int, float), f"{where}/memory", 0.82)
        ),
        kv_block_tokens=_get(mem, "kv_block_tokens", int, f"{where}/memory", 64),
    )
    if memory.kv_block_tokens < 1:
        raise UsageError(f"{where}/memory/kv_block_tokens: must be at least 1")

    vllm = _get(data, "vllm", dict, where, {})
    cont = _get(data, "container", dict, where, {})
    env = _get(cont, "env", dict, f"{where}/container", {})
    for k, v in env.items():
        if not ENV_NAME_RE.fullmatch(k):
            raise UsageError(f"{where}/container/env: {k!r} is not an environment variable name (letters, digits "
                             "and '_', not starting with a digit)")
        if not isinstance(v, str):
            raise UsageError(f"{where}/container/env/{k}: should be a string, got {v!r}")
    container = ContainerOptions(
        network=_get(cont, "network", str, f"{where}/container", "host"),
        ipc=_get(cont, "ipc", str, f"{where}/container", "host"),
        gpus=_get(cont, "gpus", str, f"{where}/container", "all"),
        devices=_str_list(cont, "devices", f"{where}/container"),
        cap_add=_str_list(cont, "cap_add", f"{where}/container"),
        mounts=_str_list(cont, "mounts", f"{where}/container"),
        env=dict(env),
    )

    images = _get(data, "images", dict, where, {})
    layers = []
    for i, layer in enumerate(_get(images, "layers", list, f"{where}/images", [])):
        lw = f"{where}/images/layers/{i}"
        if not isinstance(layer, dict):
            raise UsageError(f"{lw}: should be a table")
        lname = _get(layer, "name", str, lw)
        if not _LAYER_NAME_RE.match(lname) or ".." in lname:
            raise UsageError(f"{lw}/name: {lname!r} is not a layer name (lower-case letters, digits, '.', '_', '-', "
                             "starting with a letter or digit, no '..', at most 128)")
        dockerfile = _get(layer, "dockerfile", str, lw, f"Dockerfile.{lname}")
        if not _PLAIN_NAME_RE.match(dockerfile):
            raise UsageError(f"{lw}/dockerfile: {dockerfile!r} should be a file name in $MODEL/serving/ "
                             "(letters, digits, '.', '_', '-'; no folders)")
        if "payload" in layer:
            raise UsageError(f"{lw}/payload: no longer used: the layer's Dockerfile in $MODEL/serving/ says "
                             "what it copies", fix=f"remove payload from {path}")
        expect = _get(layer, "expect", dict, lw, {})
        for key, value in expect.items():
            if key not in VERSION_KEYS or not isinstance(value, str):
                raise UsageError(f"{lw}/expect/{key}: expected one of {', '.join(VERSION_KEYS)} = \"<version>\"")
        layers.append(ImageLayer(name=lname, dockerfile=dockerfile, expect=dict(expect)))
    prebuilt = None
    if "prebuilt" in images:
        pw = f"{where}/images/prebuilt"
        table = _get(images, "prebuilt", dict, f"{where}/images")
        prebuilt = Prebuilt(source=_get(table, "source", str, pw))
        if layers:
            raise UsageError(f"{pw}: a recipe runs a prebuilt image or builds a chain, not both "
                             f"(it also lists {len(layers)} [[images.layers]])", fix=f"remove one from {path}")
    extra_args = _str_list(vllm, "extra_args", f"{where}/vllm")
    refusal = secret_flag_refusal(list(extra_args))
    if refusal:  # on every rank's command line
        raise UsageError(f"{where}/vllm/extra_args {refusal}")
    ckpt = _get(data, "checkpoint", dict, where, {})
    fabric = _fabric(_get(data, "fabric", dict, where, {}), f"{where}/fabric")
    return Recipe(
        name=name,
        path=path,
        description=_get(data, "description", str, where, ""),
        defaults=dict(defaults),
        memory=memory,
        vllm_extra_args=extra_args,
        dspark_speculative_config=_get(vllm, "dspark_speculative_config", str, f"{where}/vllm", None),
        container=container,
        tag_prefix=_get(images, "tag_prefix", str, f"{where}/images", f"sparkctl/{name}"),
        layers=tuple(layers),
        layout_name=_get(ckpt, "layout", str, f"{where}/checkpoint", name),
        fabric=fabric,
        prebuilt=prebuilt,
    )


def _fabric(data: dict[str, Any], where: str) -> FabricTest:
    d = FabricTest()
    known = set(FabricTest.__dataclass_fields__)
    for key in data:
        if key not in known:
            raise UsageError(f"{where}/{key}: unknown key", fix=f"known: {', '.join(sorted(known))}")
    backend = _get(data, "backend", str, where, d.backend)
    if backend not in ("nccl", "gloo"):
        raise UsageError(f"{where}/backend: should be nccl or gloo, got {backend!r}")
    sizes = _get(data, "sizes", list, where, list(d.sizes))
    if not sizes or not all(isinstance(x, int) and not isinstance(x, bool) and 4 <= x <= 1 << 32 for x in sizes):
        raise UsageError(f"{where}/sizes: should be a list of byte counts from 4 to 4 GiB")
    fab = FabricTest(
        backend=backend,
        image=_get(data, "image", str, where, d.image),
        sizes=tuple(sizes),
        warmup=_get(data, "warmup", int, where, d.warmup),
        iters=_get(data, "iters", int, where, d.iters),
        timeout_s=float(_get(data, "timeout_s", (int, float), where, d.timeout_s)),
        busbw_floor_gbps=float(_get(data, "busbw_floor_gbps", (int, float), where, d.busbw_floor_gbps)),
        expect_rdma=_get(data, "expect_rdma", bool, where, d.expect_rdma),
    )
    if not (0 <= fab.warmup <= 100 and 1 <= fab.iters <= 1000 and 5 <= fab.timeout_s <= 600 and fab.busbw_floor_gbps >= 0):
        raise UsageError(f"{where}: warmup 0..100, iters 1..1000, timeout_s 5..600, busbw_floor_gbps >= 0")
    return fab
