"""Recipes: everything that differs between deployments, as data files (recipes/<name>.toml).

A recipe names the knob defaults, the memory profile, the extra vLLM arguments, the container
options, the image chain (base, ordered layers, payload files per layer) and the checkpoint layout
rules. Loading checks the file's shape and names the file and the key that is wrong.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UsageError
from .resources import recipes_dir

DEFAULT_RECIPE = "glm53-exl3-tp4"


@dataclass(frozen=True)
class MemoryProfile:
    overhead_gib: float = 14.0
    os_reserve_gib: float = 4.0
    gpu_memory_utilization_cap: float = 0.82
    indexer_extra_bytes: int = 4
    kv_block_tokens: int = 64


@dataclass(frozen=True)
class ImageLayer:
    name: str
    payload: tuple[str, ...]


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
class Recipe:
    name: str
    path: Path
    description: str
    defaults: dict[str, Any]
    memory: MemoryProfile
    vllm_extra_args: tuple[str, ...]
    dspark_speculative_config: str | None
    container: ContainerOptions
    dockerfiles: str
    tag_prefix: str
    layers: tuple[ImageLayer, ...]
    layout_name: str

    @property
    def checkpoint_layout(self) -> dict[str, Any]:
        """The rules `verify-model` applies (recipes/layouts/<layout>.json)."""
        path = recipes_dir() / "layouts" / f"{self.layout_name}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UsageError(f"recipe {self.name}: checkpoint layout {self.layout_name!r} not found ({path})") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"checkpoint layout {path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise UsageError(f"checkpoint layout {path}: expected a JSON object")
        return data

    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.toml"))


def load_recipe(name_or_path: str) -> Recipe:
    """Load a shipped recipe by name, or a recipe file by path."""
    candidate = Path(name_or_path)
    if name_or_path.endswith(".toml") or "/" in name_or_path:
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
    return _parse(data, path)


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
    known_top = {"name", "description", "defaults", "memory", "vllm", "container", "images", "checkpoint"}
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
        indexer_extra_bytes=_get(mem, "indexer_extra_bytes", int, f"{where}/memory", 4),
        kv_block_tokens=_get(mem, "kv_block_tokens", int, f"{where}/memory", 64),
    )
    if memory.kv_block_tokens < 1:
        raise UsageError(f"{where}/memory/kv_block_tokens: must be at least 1")

    vllm = _get(data, "vllm", dict, where, {})
    cont = _get(data, "container", dict, where, {})
    env = _get(cont, "env", dict, f"{where}/container", {})
    for k, v in env.items():
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
        layers.append(ImageLayer(name=_get(layer, "name", str, lw), payload=_str_list(layer, "payload", lw)))
    ckpt = _get(data, "checkpoint", dict, where, {})
    return Recipe(
        name=name,
        path=path,
        description=_get(data, "description", str, where, ""),
        defaults=dict(defaults),
        memory=memory,
        vllm_extra_args=_str_list(vllm, "extra_args", f"{where}/vllm"),
        dspark_speculative_config=_get(vllm, "dspark_speculative_config", str, f"{where}/vllm", None),
        container=container,
        dockerfiles=_get(images, "dockerfiles", str, f"{where}/images", "chain"),
        tag_prefix=_get(images, "tag_prefix", str, f"{where}/images", f"sparkctl/{name}"),
        layers=tuple(layers),
        layout_name=_get(ckpt, "layout", str, f"{where}/checkpoint", name),
    )
