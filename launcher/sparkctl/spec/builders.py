"""Builders: pure functions that return the exact command lines sparkctl runs (Kamal style).

No I/O here. Every function returns an argv list; whoever sends one across SSH joins it with
shlex.join, so every value is quoted. Tests pin these lists as exact strings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..errors import UsageError
from .planner import Plan
from .recipes import ENV_NAME_RE
from .settings import RankPins, Settings

LABEL_CLUSTER = "sparkctl.cluster"
LABEL_RANK = "sparkctl.rank"
LABEL_REPLICA = "sparkctl.replica"  # only when REPLICAS > 1: one replica's containers are today's, byte for byte
LABEL_CONFIG_HASH = "sparkctl.config-hash"
LABEL_RECIPE = "sparkctl.recipe"
LABEL_LAYER = "sparkctl.layer"
LABEL_CONTENT_HASH = "sparkctl.content-hash"
LABEL_VERSION = "sparkctl.version"
LABEL_VERSIONS = "sparkctl.versions"  # JSON: what the image reports (vllm, torch, exllamav3, nccl), see image/chain.py
REMOTE_STATE_DIR = ".sparkctl"  # relative to the SSH user's home: where rank env files live on a node


@dataclass(frozen=True)
class RankSpec:
    """Everything that defines one rank's container, before the config hash is known."""

    rank: int
    node: str
    pins: RankPins
    env: dict[str, str]
    vllm_argv: list[str]


DEFAULT_CLUSTER = "sparkctl"  # CLUSTER_NAME's default
CONTAINER = "@@sparkctl-container@@"  # the word of a rank's docker argv where its container's name goes


def container_name(cluster: str, rank: int) -> str:
    """`sparkctl-rankN` for the default cluster, `sparkctl-<cluster>-rankN` for any other. Names are for
    people: sparkctl finds its containers by their labels (cluster, rank), never by name, except where
    docker wants one name (logs, exec), and those go through `rank_docker_argv`."""
    return f"sparkctl-rank{rank}" if cluster == DEFAULT_CLUSTER else f"sparkctl-{cluster}-rank{rank}"


def legacy_container_name(cluster: str, rank: int) -> str | None:
    """The name earlier versions gave the default cluster's ranks (`sparkctl-sparkctl-rankN`), under which a
    service they started still runs (`up` keeps an identical service, whatever its names); None for the
    clusters whose name did not change."""
    old = f"sparkctl-{cluster}-rank{rank}"
    return None if old == container_name(cluster, rank) else old


# Run argv with its first CONTAINER word replaced by the rank's container name: the current name, or the
# legacy one when only a container of that name exists on the node. Names are positional arguments.
_PICK_CONTAINER = r'''new="$1"; old="$2"; mark="$3"; shift 3; n="$new"
if ! docker container inspect "$new" >/dev/null 2>&1 && docker container inspect "$old" >/dev/null 2>&1; then
  n="$old"
fi
swapped=0
for a in "$@"; do
  shift
  if [ "$swapped" = 0 ] && [ "$a" = "$mark" ]; then set -- "$@" "$n"; swapped=1; else set -- "$@" "$a"; fi
done
exec "$@"'''


def rank_docker_argv(cluster: str, rank: int, argv: Sequence[str]) -> list[str]:
    """A docker command about one rank's container (`argv` holds CONTAINER where the name goes), which also
    reaches a container that still has the legacy name (`legacy_container_name`)."""
    new, old = container_name(cluster, rank), legacy_container_name(cluster, rank)
    if old is None:
        out, done = [], False
        for a in argv:
            out.append(new if a == CONTAINER and not done else a)
            done = done or a == CONTAINER
        return out
    return ["sh", "-c", _PICK_CONTAINER, "sparkctl-rank", new, old, CONTAINER, *argv]


def remote_env_file(cluster: str, rank: int) -> str:
    return f"{REMOTE_STATE_DIR}/{cluster}/rank{rank}.env"


def master_addr(settings: Settings, pins: list[RankPins]) -> str:
    addr = settings.get("MASTER_ADDR") or pins[0].fabric_ip
    if not addr:
        key = settings.rank_key(0, "FABRIC_IP")  # replica r's head: RANK<its position in NODES>_FABRIC_IP
        raise UsageError(f"the head's fabric IP is not known ({key} / MASTER_ADDR)",
                         fix=f"run `sparkctl check` to discover it, or set {key} in the env file")
    return str(addr)


def speculative_config(settings: Settings) -> str | None:
    method = settings.get("SPEC_METHOD")
    if method not in ("mtp", "dspark"):
        return None  # SPEC_K means nothing then (a recipe without a speculator need not set it)
    tokens = settings.getint("SPEC_K")
    if method == "mtp":
        return json.dumps({"method": "mtp", "num_speculative_tokens": tokens}, separators=(",", ":"))
    if method == "dspark":
        template = settings.recipe.dspark_speculative_config or ""
        doc = json.loads(template.replace("{dir}", json.dumps(str(settings.get("DSPARK")))[1:-1])
                         .replace("{tokens}", str(tokens)))
        return json.dumps(doc, separators=(",", ":"))
    return None


def kv_cache_bytes(settings: Settings, plan: Plan) -> int:
    override = settings.get("KV_CACHE_MEMORY_BYTES")
    return int(override) if override else plan.kv_cache_memory_bytes


def vllm_serve_argv(settings: Settings, plan: Plan, rank: int, pins: list[RankPins]) -> list[str]:
    """`vllm serve` for one rank: the mp multi-node flags, TP/DCP, explicit KV bytes, MTP, port."""
    nnodes = len(settings.nodes)
    argv = [
        "vllm", "serve", str(settings.model),
        "--served-model-name", str(settings.get("SERVED_MODEL_NAME")),
        "--port", str(settings.getint("PORT")),
        "--tensor-parallel-size", str(settings.getint("TP")),
        "--decode-context-parallel-size", str(settings.getint("DCP")),
        "--dcp-comm-backend", str(settings.get("DCP_COMM_BACKEND")),
        "--nnodes", str(nnodes),
        "--node-rank", str(rank),
        "--master-addr", master_addr(settings, pins),
        "--master-port", str(settings.getint("MASTER_PORT")),
        "--max-model-len", str(settings.getint("MAX_MODEL_LEN")),
        "--kv-cache-dtype", str(settings.get("KV_CACHE_DTYPE")),
        "--kv-cache-memory-bytes", str(kv_cache_bytes(settings, plan)),
        "--gpu-memory-utilization", f"{float(settings.get('GPU_MEMORY_UTILIZATION')):g}",
    ]
    spec = speculative_config(settings)
    if spec:
        argv += ["--speculative-config", spec]
    argv += list(settings.recipe.vllm_extra_args)
    argv += settings.vllm_extra_args()  # validated words, each one argv item (never a shell)
    if rank > 0:
        argv.append("--headless")
    return argv


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def api_bind_host(settings: Settings) -> str:
    """The address the head's API listens on: the last --host of the recipe or VLLM_EXTRA_ARGS, else
    vLLM's default, every interface."""
    host = "0.0.0.0"
    words = [*settings.recipe.vllm_extra_args, *settings.vllm_extra_args()]
    for i, word in enumerate(words):
        if word == "--host" and i + 1 < len(words):
            host = words[i + 1]
        elif word.startswith("--host="):
            host = word.split("=", 1)[1]
    return host


def open_api_warning(settings: Settings) -> str | None:
    """One line when the API will answer anyone who can reach the head without a key, else None."""
    host = api_bind_host(settings)
    if settings.get("VLLM_API_KEY") or host in LOOPBACK_HOSTS or host.startswith("127."):
        return None
    return (f"the API on {settings.head}:{settings.getint('PORT')} will listen on {host} without an API key: "
            "anyone who can reach that port can use the model; set VLLM_API_KEY (env file) or bind it to "
            "loopback with VLLM_EXTRA_ARGS='--host 127.0.0.1'")


def rank_env(settings: Settings, rank: int, pins: RankPins) -> dict[str, str]:
    """The container environment of one rank: its own NIC pins, then recipe, the model card launcher's knobs (docs/sources.md) and secrets.

    Secrets travel in this env file (mode 0600 on the node), never on a command line.
    """
    missing = pins.missing()
    if missing:
        keys = ", ".join(settings.rank_key(rank, m) for m in missing)
        raise UsageError(f"rank {rank} ({settings.nodes[rank]}): {keys} not known",
                         fix="run `sparkctl check` to discover the fabric pins, or set them in the env file")
    env = {
        "NCCL_SOCKET_IFNAME": str(pins.netdev),
        "GLOO_SOCKET_IFNAME": str(pins.netdev),
        "NCCL_IB_HCA": str(pins.rdma_dev),
        "NCCL_IB_GID_INDEX": str(pins.gid_index),
        "VLLM_HOST_IP": str(pins.fabric_ip),
    }
    env.update(settings.recipe.container.env)
    env["ABLIT"] = str(settings.get("ABLIT", 0))
    if settings.get("HEAD_Q"):
        env["HEAD_Q"] = str(settings.get("HEAD_Q"))
    env.update(settings.passthrough_env())
    env.update(settings.secrets())
    return env


def env_file_text(env: dict[str, str]) -> str:
    """docker --env-file format: KEY=value per line, taken literally (no quotes, no expansion)."""
    for key, value in env.items():
        if not ENV_NAME_RE.fullmatch(key):
            raise UsageError(f"{key!r}: a container environment variable's name is letters, digits and '_'")
        if "\n" in value or "\r" in value or "\x00" in value:
            raise UsageError(f"{key}: a container environment value cannot contain a newline or NUL")
    return "".join(f"{k}={v}\n" for k, v in sorted(env.items()))


def rank_specs(settings: Settings, plan: Plan, pins: list[RankPins]) -> list[RankSpec]:
    """Every rank of the service `settings` describes (one replica: a replica view, or the one service)."""
    return [
        RankSpec(r.rank, r.node, pins[r.rank], rank_env(settings, r.rank, pins[r.rank]),
                 vllm_serve_argv(settings, plan, r.rank, pins))
        for r in settings.service.ranks
    ]


def config_hash(settings: Settings, specs: list[RankSpec]) -> str:
    """One hash for the whole cluster: any change on any rank replaces every rank (TP restarts together).

    Secrets enter only as their own SHA-256, so the hash changes with a rotated key but never reveals it.
    """
    secrets = settings.secrets()

    def scrub(env: dict[str, str]) -> dict[str, str]:
        return {k: (hashlib.sha256(v.encode()).hexdigest() if k in secrets else v) for k, v in env.items()}

    doc: dict[str, Any] = {
        "image": settings.image,
        "recipe": settings.recipe.name,
        "container": container_options(settings),
        "ranks": [{"node": s.node, "env": scrub(s.env), "argv": s.vllm_argv} for s in specs],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def container_options(settings: Settings) -> list[str]:
    c = settings.recipe.container
    nofile = settings.getint("ULIMIT_NOFILE")
    memlock = settings.getint("ULIMIT_MEMLOCK")
    opts = [
        "--network", c.network,
        "--ipc", c.ipc,
        "--ulimit", f"nofile={nofile}:{nofile}",
        "--ulimit", f"memlock={memlock}:{memlock}",
    ]
    for dev in c.devices:
        opts += ["--device", dev]
    for cap in c.cap_add:
        opts += ["--cap-add", cap]
    if c.gpus:
        opts += ["--gpus", c.gpus]
    opts += ["--shm-size", str(settings.get("SHM_SIZE"))]
    mounts = [str(settings.model), *c.mounts]
    for key in ("DSPARK", "ABLIT_HOST_DIR"):
        if settings.get(key):
            mounts.append(str(settings.get(key)))
    for path in mounts:  # the model and its companions are mounted read-only, always
        opts += ["--mount", f"type=bind,source={path},target={path},readonly"]
    return opts


def docker_run_argv(settings: Settings, spec: RankSpec, cfg_hash: str) -> list[str]:
    """`docker run` of one rank. The entrypoint is explicit: vLLM's image (and the base built on it)
    has ENTRYPOINT ["vllm", "serve"], so `IMAGE vllm serve ...` would run `vllm serve vllm serve ...`;
    `--entrypoint vllm IMAGE serve ...` runs the same command whatever the image declares."""
    cluster = settings.cluster_name
    entrypoint, *args = spec.vllm_argv
    return [
        "docker", "run", "--detach",
        "--name", container_name(cluster, spec.rank),
        "--label", f"{LABEL_CLUSTER}={cluster}",
        "--label", f"{LABEL_RANK}={spec.rank}",
        *(["--label", f"{LABEL_REPLICA}={settings.replica_index}"] if settings.replica_count > 1 else []),
        "--label", f"{LABEL_CONFIG_HASH}={cfg_hash}",
        "--label", f"{LABEL_RECIPE}={settings.recipe.name}",
        "--restart", "no",
        *container_options(settings),
        "--env-file", remote_env_file(cluster, spec.rank),
        "--entrypoint", entrypoint,
        settings.image,
        *args,
    ]


def image_labels(recipe: str, layer: str, content_hash: str) -> dict[str, str]:
    """Labels every image sparkctl builds carries (build skips a layer whose content hash matches)."""
    return {LABEL_RECIPE: recipe, LABEL_LAYER: layer, LABEL_CONTENT_HASH: content_hash, LABEL_VERSION: __version__}


def docker_build_argv(tag: str, base: str, labels: dict[str, str], context: str, *, no_cache: bool = False,
                      base_arg: str = "BASE") -> list[str]:
    """`docker build` of one chain layer; `base_arg` is the Dockerfile's build argument for its parent."""
    argv = ["docker", "build", "--tag", tag, "--build-arg", f"{base_arg}={base}"]
    for key, value in sorted(labels.items()):
        argv += ["--label", f"{key}={value}"]
    if no_cache:
        argv.append("--no-cache")
    return argv + [context]
