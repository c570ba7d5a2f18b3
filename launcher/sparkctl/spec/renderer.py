"""Rendering: env.tp4 from templates/ (jinja2, StrictUndefined) and the per-rank command lines.

Pure apart from `write_private`. A value that is needed and not known is an error that names the key,
never an empty line in the output.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from .. import __version__
from ..errors import UsageError
from .builders import RankSpec, config_hash, docker_run_argv, kv_cache_bytes, master_addr, rank_specs
from .planner import Plan, gb
from .resources import data_dir
from .settings import RANK_KEY_RE, RankPins, Settings, is_secret


def _dotenv_quote(value: Any) -> str:
    """Quote a value for a dotenv file so python-dotenv (and `set -a; . file`) read it back literally."""
    text = str(value)
    if text and all(c.isalnum() or c in "._/-:@+" for c in text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


@functools.cache
def _env() -> jinja2.Environment:
    """One Environment per process: it keeps the compiled template (a replica's render would compile it
    again, ~20 ms of CPU each)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - renders env files, not HTML
    )
    env.filters["q"] = _dotenv_quote
    return env


def resolve_pins(settings: Settings, discovered: dict[int, RankPins] | None = None) -> list[RankPins]:
    """Per-rank pins: discovered by `check` where given, else from the RANK<n>_* knobs."""
    out = []
    for rank in range(len(settings.service.ranks)):
        given = settings.rank_pins(rank)
        found = (discovered or {}).get(rank)
        if found is None:
            out.append(given)
            continue
        out.append(RankPins(
            fabric_ip=found.fabric_ip or given.fabric_ip,
            netdev=found.netdev or given.netdev,
            rdma_dev=found.rdma_dev or given.rdma_dev,
            gid_index=found.gid_index if found.gid_index is not None else given.gid_index,
        ))
    return out


def require_pins(settings: Settings, pins: list[RankPins]) -> None:
    missing = [f"{settings.rank_key(r, m)} ({settings.nodes[r]})" for r, p in enumerate(pins) for m in p.missing()]
    if missing:
        raise UsageError(
            "fabric pins not known: " + ", ".join(missing),
            fix="run `sparkctl check`: it discovers them on every node and writes them into env/env.tp4, itself an "
                "env file (`sparkctl --env-file env/env.tp4 render …`); or set them in your env file",
        )


@dataclass(frozen=True)
class Rendered:
    env_tp4: str
    specs: list[RankSpec]
    config_hash: str
    docker_argv: list[list[str]]


def render_all(settings: Settings, plan: Plan, pins: list[RankPins], *, now: _dt.datetime | None = None,
               source: str = "sparkctl render") -> Rendered:
    require_pins(settings, pins)
    specs = rank_specs(settings, plan, pins)
    h = config_hash(settings, specs)
    text = render_env_tp4(settings, plan, pins, cfg_hash=h, now=now, source=source)
    return Rendered(text, specs, h, [docker_run_argv(settings, s, h) for s in specs])


def render_env_tp4(settings: Settings, plan: Plan, pins: list[RankPins], *, cfg_hash: str,
                   now: _dt.datetime | None = None, source: str = "sparkctl render") -> str:
    require_pins(settings, pins)
    now = now or _dt.datetime.now(_dt.UTC)
    ctx = {
        "version": __version__,
        "rendered_at": now.strftime("%Y-%m-%d %H:%M:%SZ"),
        "source": source,
        "config_hash": cfg_hash,
        "recipe": settings.recipe.name,
        "nodes": settings.nodes,
        "model": str(settings.model),
        "cluster": settings.cluster_name,
        "tp": settings.getint("TP"),
        "dcp": settings.getint("DCP"),
        "dcp_comm_backend": settings.get("DCP_COMM_BACKEND"),
        "max_model_len": settings.getint("MAX_MODEL_LEN"),
        "max_full_seqs": settings.getint("MAX_FULL_SEQS"),
        "kv_cache_dtype": settings.get("KV_CACHE_DTYPE"),
        "kv_cache_memory_bytes": kv_cache_bytes(settings, plan),
        "plan_summary": (
            f"weights {gb(plan.weights_per_rank)} + KV {gb(plan.kv_cache_memory_bytes)} "
            f"({plan.kv_blocks_per_rank} blocks × {plan.kv_block_tokens} tokens × "
            + (f"{plan.kv_block_bytes // plan.kv_block_tokens} B of {plan.kv_group_layers}-layer groups, "
               if plan.kv_group_layers else f"{plan.kv_bytes_per_token} B, ")
            + f"{plan.kv_cache_dtype_effective} on SM{plan.compute_capability}) + overhead {gb(plan.overhead_bytes)} "
            f"= {gb(plan.per_rank_total)} per rank of {gb(plan.node_memory_bytes)}"
        ),
        "gpu_memory_utilization": f"{float(settings.get('GPU_MEMORY_UTILIZATION')):g}",
        "port": settings.getint("PORT"),
        "master_addr": master_addr(settings, pins),
        "master_port": settings.getint("MASTER_PORT"),
        "served_model_name": settings.get("SERVED_MODEL_NAME"),
        "spec_method": settings.get("SPEC_METHOD"),
        "spec_k": settings.get("SPEC_K") or "",  # unset for a recipe without a speculator (lab-vllm)
        "dspark": settings.get("DSPARK"),
        "ablit": settings.get("ABLIT", 0),
        "ablit_host_dir": settings.get("ABLIT_HOST_DIR"),
        "head_q": settings.get("HEAD_Q"),
        "vllm_extra_args": settings.get("VLLM_EXTRA_ARGS"),
        "image": settings.image,
        "ulimit_nofile": settings.getint("ULIMIT_NOFILE"),
        "ulimit_memlock": settings.getint("ULIMIT_MEMLOCK"),
        "shm_size": settings.get("SHM_SIZE"),
        "fabric_subnet": settings.get("FABRIC_SUBNET"),
        "replica": settings.replica_index,
        "replica_count": settings.replica_count,
        "rank_offset": settings.rank_offset,
        "ranks": [{"rank": r.rank, "node": r.node, "pins": pins[r.rank]} for r in settings.service.ranks],
        "secrets_left_out": sorted(settings.secrets()),
    }
    try:
        text = _env().get_template("env.tp4.j2").render(**ctx)
    except jinja2.UndefinedError as exc:  # a template asks for something render does not provide
        raise UsageError(f"templates/env.tp4.j2: {exc.message}") from None
    return text + _carried(settings, text)


_KEY_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*)=", re.MULTILINE)


def _carried(settings: Settings, text: str) -> str:
    """The lines of every key set outside the recipe (env file, environment, command line) that the
    template did not write, so env.tp4 loaded as an env file gives the same service: passthrough families
    (NCCL_*), DROP_CACHES, MEMORY_WAIT_S... Never a secret (the template names them), never another rank's
    pin (the template writes this service's)."""
    written = set(_KEY_LINE.findall(text))
    lines = [f"{key}={_dotenv_quote(v.raw) if v.raw else ''}\n" for key, v in sorted(settings.values.items())
             if key not in written and not v.source.startswith("recipe ") and not is_secret(key)
             and not RANK_KEY_RE.match(key)]
    if not lines:
        return ""
    return "\n# Also set where these settings came from (kept, so this file loads the same service):\n" + \
        "".join(lines)


def env_tp4_path(base: Path, replica: int) -> Path:
    """Replica 0's env.tp4 is `base` (env/env.tp4, as with one replica); replica i's is `base`.replica<i>."""
    return base if replica == 0 else base.with_name(f"{base.name}.replica{replica}")


def env_file_in_use(path: Path, settings: Settings) -> bool:
    """Is `path` the env file `settings` were read from, by any name (another spelling, a symlink, a hard
    link)? sparkctl never writes over its own input."""
    if settings.env_file is None:
        return False
    try:
        return os.path.samefile(path, settings.env_file)
    except OSError:  # one of them is not there: the same file only by its resolved name
        return path.resolve() == settings.env_file.resolve()


OUT_FIX = "write the rendered one elsewhere with --out PATH"  # render's and check's way out


def write_env_tp4(path: Path, text: str, settings: Settings, *, fix: str) -> str | None:
    """Write a rendered env.tp4 (write_private), unless `path` is the env file `settings` were read from:
    then leave it as it is and return why (for a warning), with `fix`."""
    if not env_file_in_use(path, settings):
        write_private(path, text)
        return None
    return (f"{path} not written: it is the env file this command read ({settings.env_file}), which sparkctl "
            f"never rewrites (it would lose every line the renderer does not write); {fix}")


def write_private(path: Path, text: str) -> None:
    """Write atomically with mode 0600 (the file may pin addresses of a private fabric, or secrets)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
