"""Settings: every knob, where its value came from, and the rules it must satisfy.

Sources, lowest to highest precedence:
    recipe defaults < env file < process environment < CLI flags
The env file is `--env-file`, else $SPARKCTL_ENV_FILE, else env/cluster.env when it exists.
Every value remembers its source so that an error can say "TP=4 must be divisible by DCP=3
(DCP from env/cluster.env)" and `sparkctl config` can show where each value came from.
Secrets (anything named *TOKEN*, *KEY*, *SECRET*, *PASSWORD*) are never shown.
"""

from __future__ import annotations

import difflib
import io
import ipaddress
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dotenv import dotenv_values

from ..errors import UsageError
from .recipes import DEFAULT_RECIPE, Recipe, load_recipe
from .topology import Replica, Topology, TopologyError, build_topology
from .vllm_flags import check_extra_words, names_a_secret_flag

REDACTED = "[REDACTED]"
_SECRET_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
DEFAULT_ENV_FILE = Path("env/cluster.env")

# Values that reach a shell, a file or a label must not carry these.
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_NETDEV_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_CC_RE = re.compile(r"^\d{1,2}\.\d{1,2}$")
_CLUSTER_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_SIZE_RE = re.compile(r"^[0-9]+[bkmg]?$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
_URL_RE = re.compile(r"^https?://[A-Za-z0-9.:\[\]_-]+(/[A-Za-z0-9._~/-]*)?$")
_COMMAND_RE = re.compile(r"^[A-Za-z0-9._/+-]{1,255}$")
IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]{0,254}$", re.IGNORECASE)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "fp8_inc")
RANK_KEY_RE = re.compile(r"^RANK(\d+)_(FABRIC_IP|CX7_IF|CX7_IB|GID_INDEX)$")
#: The bash launcher's SKIP_* switches (the one sparkctl replaces): accepted so an old env file loads (sparkctl's commands replace them).
LEGACY_RE = re.compile(r"^SKIP_[A-Z0-9_]+$")
#: A prefix of CONTAINER_ENV_PREFIXES: upper-case, ending in "_" (so it names a family of keys, never all of them).
_PREFIX_RE = re.compile(r"^[A-Z][A-Z0-9]*_$")
# A key sparkctl reads: nothing that could end a line or a word in a file it writes (a rank's env file,
# env.tp4, the systemd unit). fullmatch, never `$`, which also matches before a final newline.
KEY_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
PASSTHROUGH_DOC = "Passed to the containers' environment as it is (its prefix is in CONTAINER_ENV_PREFIXES)."
LEGACY_DOC = "The bash launcher's switch: accepted so an old env file loads; sparkctl's own commands replace it."


def is_secret(key: str) -> bool:
    return bool(_SECRET_RE.search(key))


# ----------------------------------------------------------------------------------------------
# Knob registry


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # str | int | float | list | path | bool
    doc: str
    required: bool = False
    check: Callable[[Any], str | None] | None = None  # returns the rule broken, or None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()


def _prefixes(value: Any) -> str | None:
    bad = [p for p in value or [] if not _PREFIX_RE.match(p)]
    if bad:
        return f"holds {', '.join(map(repr, bad))}: each prefix is upper-case letters and digits ending in '_'"
    return None


def _no_control(value: Any) -> str | None:
    if isinstance(value, str) and _CONTROL_RE.search(value):
        return "must not contain control characters (newlines, tabs, NUL)"
    return None


def _abs_path(value: Any) -> str | None:
    if value in (None, ""):
        return None
    if not str(value).startswith("/"):
        return "must be an absolute path"
    if "," in str(value) or '"' in str(value):
        return "must not contain ',' or '\"' (docker --mount cannot bind such a path)"
    return _no_control(value)


def _served_name(value: Any) -> str | None:
    if value in (None, ""):
        return None
    if str(value).startswith("-"):
        return "must not start with '-' (vLLM would read it as a flag)"
    return _no_control(value)


_FLAG_RE = re.compile(r"^--[a-z0-9][a-z0-9-]*(\.[a-z0-9_.+-]+)?$")  # --name or vLLM's dotted --name.key
MAX_EXTRA_ARGS_CHARS = 8192


def parse_vllm_extra_args(text: str) -> list[str]:
    """VLLM_EXTRA_ARGS as argv words (shell-like quoting, nothing expanded); raises ValueError with the rule.

    Every flag is a full `--long-name` (or `--long-name=value`) of lower-case letters, digits and '-';
    a word that does not start with '-' is a value and must follow a flag. A value that starts with
    '-' is written `--flag=-value`. Each flag is then resolved against vLLM 0.33's real option table
    (vllm_flags): unknown flags, and every alias, prefix or `--no-` form of a flag sparkctl sets, are refused.
    """
    if len(text) > MAX_EXTRA_ARGS_CHARS:
        raise ValueError(f"is longer than {MAX_EXTRA_ARGS_CHARS} characters")
    try:
        words = shlex.split(text, comments=False, posix=True)
    except ValueError as exc:  # an unclosed quote
        raise ValueError(f"cannot be split into words ({exc})") from None
    for i, word in enumerate(words):
        if not word.startswith("-"):
            if i == 0:
                raise ValueError(f"starts with the value {word!r}: each value must follow a --flag")
            continue
        flag = word.split("=", 1)[0]
        if not _FLAG_RE.match(flag) or len(flag) < 3:
            raise ValueError(f"has {flag!r}: flags must be full --long-names of a-z, 0-9 and '-' "
                             "(short forms and prefixes are ambiguous to vLLM; write --flag=-value for a "
                             "value that starts with '-')")
    check_extra_words(words)
    return words


def _extra_args(value: Any) -> str | None:
    if value in (None, ""):
        return None
    try:
        parse_vllm_extra_args(str(value))
    except ValueError as exc:
        return str(exc)
    return None


def _nodes(value: Any) -> str | None:
    if not value:
        return "must name at least one SSH host alias"
    seen: set[str] = set()
    for alias in value:
        if not _ALIAS_RE.match(alias):
            return (
                f"node alias {alias!r} is not a valid SSH host alias "
                "(letters, digits, '.', '_', '-'; define it in your ssh config)"
            )
        if alias in seen:
            return f"node {alias!r} is listed twice"
        seen.add(alias)
    return None


def _regex(rx: re.Pattern[str], what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value in (None, ""):
            return None
        return None if rx.match(str(value)) else f"must be {what}"

    return check


def _cidr(value: Any) -> str | None:
    if not value:
        return None
    try:
        ipaddress.IPv4Network(str(value), strict=False)
    except ValueError:
        return "must be an IPv4 network in CIDR form, e.g. 192.168.100.0/24"
    return None


_CLAIM_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _model_volume(value: Any) -> str | None:
    if value in (None, "", "hostpath"):
        return None
    text = str(value)
    if text.startswith("pvc:") and _CLAIM_RE.match(text[4:]):
        return None
    return "must be hostpath or pvc:<claim> (a PersistentVolumeClaim name: lower-case letters, digits, '-', '.')"


def _ipv4(value: Any) -> str | None:
    if not value:
        return None
    try:
        ipaddress.IPv4Address(str(value))
    except ValueError:
        return "must be an IPv4 address"
    return None


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in [
        Knob("NODES", "list", "SSH host aliases of the ranks, head (rank 0) first; with REPLICAS > 1, replica r "
             "is the r-th group of TP/GPUS_PER_NODE nodes, its first node its head.", required=True, check=_nodes),
        Knob("MODEL", "path", "Checkpoint folder, at the same path on every node.", required=True, check=_abs_path),
        Knob("RECIPE", "str", "Recipe name (glm53-exl3-tp4, glm53-exl3-2.75bpw, lab) or a recipe file."),
        Knob("CLUSTER_NAME", "str", "Name of this cluster: the value of the sparkctl.cluster label.",
             check=_regex(_CLUSTER_RE, "lower-case letters, digits, '.', '_', '-' (max 63)")),
        Knob("TP", "int", "Tensor-parallel size (one GPU per rank on GB10).", minimum=1, maximum=1024),
        Knob("DCP", "int", "Decode-context-parallel size; TP must be divisible by it.", minimum=1, maximum=1024),
        Knob("GPUS_PER_NODE", "int", "GPUs per node (1 on DGX Spark).", minimum=1, maximum=64),
        Knob("REPLICAS", "int", "Independent copies of the TP service, each on its own TP/GPUS_PER_NODE nodes "
             "(default: as many whole TP groups as NODES hold; when set it must equal that).",
             minimum=1, maximum=1024),
        Knob("DCP_COMM_BACKEND", "str", "DCP communication backend.", choices=("ag_rs", "a2a")),
        Knob("MAX_MODEL_LEN", "int", "Context length in tokens.", minimum=1, maximum=100_000_000),
        Knob("KV_CACHE_DTYPE", "str", "KV-cache dtype as asked of vLLM; the planner uses what the GPU's "
             "backend stores (fp8/auto -> fp8_ds_mla on GB10; bfloat16 is refused there).", choices=KV_CACHE_DTYPES),
        Knob("GPU_COMPUTE_CAPABILITY", "str", "GPU compute capability to plan for offline (12.1 = GB10); "
             "check and up use what the nodes' nvidia-smi reports.", check=_regex(_CC_RE, "like 12.1 or 10.0")),
        Knob("MAX_FULL_SEQS", "int", "Concurrent full-length sequences the KV cache must hold.",
             minimum=1, maximum=4096),
        Knob("GPU_MEMORY_UTILIZATION", "float", "vLLM --gpu-memory-utilization (capped by the recipe).",
             minimum=0.01, maximum=1.0),
        Knob("KV_CACHE_MEMORY_BYTES", "int", "Per-GPU KV-cache bytes; default: the planner's figure.", minimum=1),
        Knob("NODE_MEMORY_BYTES", "int", "Node memory for offline planning; check uses each node's MemTotal.",
             minimum=1),
        Knob("PORT", "int", "OpenAI API port on the head.", minimum=1, maximum=65535),
        Knob("MASTER_ADDR", "str", "Rendezvous address; default: the head's fabric IP (RANK0_FABRIC_IP). "
             "Only with one replica: each replica meets at its own head's fabric IP.",
             check=_ipv4),
        Knob("MASTER_PORT", "int", "Rendezvous port on the head's fabric address (every replica's head uses it).",
             minimum=1, maximum=65535),
        Knob("SERVED_MODEL_NAME", "str", "Model name the API serves.", required=True, check=_served_name),
        Knob("SPEC_METHOD", "str", "Speculative decoding: mtp (the checkpoint's MTP block), dspark, or off.",
             choices=("mtp", "dspark", "off")),
        Knob("SPEC_K", "int", "Speculative tokens per step (MTP k).", minimum=1, maximum=16),
        Knob("DSPARK", "path", "DSpark drafter folder (with SPEC_METHOD=dspark).", check=_abs_path),
        Knob("IMAGE", "str", "Image every rank runs: the chain's top layer, or a prebuilt recipe's published image "
             "(pin it by digest: repo@sha256:...).",
             check=_regex(IMAGE_RE, "a Docker image reference")),
        Knob("BASE_IMAGE", "str", "Base image of the chain.", check=_regex(IMAGE_RE, "a Docker image reference")),
        Knob("ULIMIT_NOFILE", "int", "Container nofile limit (soft=hard).", minimum=1024),
        Knob("ULIMIT_MEMLOCK", "int", "Container memlock limit in bytes, -1 for unlimited.", minimum=-1),
        Knob("SHM_SIZE", "str", "Container /dev/shm size (docker --shm-size).",
             check=_regex(_SIZE_RE, "a size like 64g, 512m or a byte count")),
        Knob("FABRIC_SUBNET", "str", "Fabric network (CIDR); check picks the CX7 netdev with an address in it; "
             "`setup` addresses the cabled ports from it (default 192.168.100.0/24).",
             check=_cidr),
        Knob("HEAD_Q", "str", "6-bit EXL3 head (2.75 bpw pack): on or off.", choices=("on", "off")),
        Knob("ABLIT", "int", "Load-time abliteration (0: the shards already carry it).", minimum=0, maximum=1),
        Knob("ABLIT_HOST_DIR", "path", "Host folder with the load-time abliteration files.", check=_abs_path),
        Knob("LOCAL_MODEL_DIR", "path", "Seed launcher's name for MODEL (used when MODEL is not set).",
             check=_abs_path),
        Knob("VLLM_EXTRA_ARGS", "str", "More `vllm serve` flags, after the recipe's (full --flag names; "
             "shell-like quoting, nothing expanded).", check=_extra_args),
        Knob("BUILD_KEEP_CHAINS", "int", "build: chain images kept per rank, by content-hash tag, for rollback "
             "(default 3).", minimum=1, maximum=100),
        Knob("WATCH_INTERVAL_S", "float", "watch: seconds between looks at every rank and /health (default 5).",
             minimum=0.2, maximum=3600),
        Knob("WATCH_CANARY_S", "float", "watch: seconds between canary completions (default 30).",
             minimum=0.2, maximum=86400),
        Knob("WATCH_CANARY_TIMEOUT_S", "float", "watch: a canary slower than this means a hung head (default 30).",
             minimum=0.5, maximum=3600),
        Knob("WATCH_MAX_RESTARTS", "int", "watch: restarts allowed within the window before it gives up "
             "(default 3).", minimum=0, maximum=1000),
        Knob("WATCH_RESTART_WINDOW_S", "float", "watch: the window the restart budget counts in (default 3600).",
             minimum=1, maximum=10**7),
        Knob("WATCH_BACKOFF_S", "float", "watch: wait before the 2nd restart in a window; doubles after "
             "(default 10).", minimum=0, maximum=86400),
        Knob("WATCH_NODE_WAIT_S", "float", "watch: how long to wait for an unreachable node (default 600).",
             minimum=0, maximum=10**6),
        Knob("WATCH_READY_TIMEOUT_S", "float", "watch: how long a restarted group may take to serve (default "
             "3600).", minimum=1, maximum=10**6),
        Knob("DROP_CACHES", "str", "auto (default): `up` (and watch's restart, rollback) syncs and drops the page "
             "cache on each rank node with unified memory (GB10) before starting the containers; 1: on every rank "
             "node; 0: never. As root or through `sudo -n` only (refuses the start, with the sudoers line, when "
             "it cannot).", choices=("auto", "1", "0")),
        Knob("MEMORY_WAIT_S", "float", "up (and watch's restart, rollback): how long to wait, per start, for a "
             "node's memory to come back after its containers stopped (default 120: a killed engine's memory "
             "is back within seconds to a minute); then it refuses with the numbers. 0: no wait, no judgement.",
             minimum=0, maximum=3600),
        Knob("ARGV_JUDGE_TIMEOUT_S", "float", "check and up (and watch's restart, rollback): the bound, s, of the "
             "serving image's own vLLM judging every rank's argv on the head before anything starts (default 240; "
             "cached by image, config.json and argv); past it the argv is 'not judged', a warning. 0: no judge "
             "(an image whose python3 has no vLLM, a head too small to import torch beside a running service).",
             minimum=0, maximum=3600),
        Knob("MODEL_REPO", "str", "Hub repo id `model pull` downloads (org/name); the recipe names it.",
             check=_regex(_REPO_RE, "a Hub repo id like org/name")),
        Knob("MODEL_REVISION", "str", "Hub revision `model pull` downloads: a 40-hex commit id (pinned), or a "
             "branch/tag that is resolved and recorded.", check=_regex(_REVISION_RE, "a commit id, branch or tag")),
        Knob("HF_ENDPOINT", "str", "Hub endpoint the head downloads from (default: huggingface.co).",
             check=_regex(_URL_RE, "an http(s) URL")),
        Knob("HF_PYTHON", "str", "Python on the head that has huggingface_hub (`model pull` runs there).",
             check=_regex(_COMMAND_RE, "a command name or absolute path")),
        Knob("LWS_MODEL_VOLUME", "str", "render --target lws: how pods get MODEL (read-only, at the same path): "
             "hostpath (default: the folder on every node) or pvc:<claim> (a PersistentVolumeClaim).",
             check=_model_volume),
        Knob("CONTAINER_ENV_PREFIXES", "list", "Prefixes of keys passed into every container's environment as "
             "they are, e.g. NCCL_ (a recipe may set it in its [defaults]). A key with one "
             "of them is accepted in the env file and set after sparkctl's own variables (so NCCL_IB_HCA=... there "
             "overrides the discovered pin); knobs are never passed this way.", check=_prefixes),
        Knob("HF_TOKEN", "str", "Hugging Face token (secret; never shown, passed by file)."),
        Knob("VLLM_API_KEY", "str", "API key the service requires (secret; passed by file, not argv)."),
    ]
}

# n is the node's position in NODES (with REPLICAS > 1: replica r's rank k is n = r*TP/GPUS_PER_NODE + k).
RANK_KNOB_DOCS = {
    "FABRIC_IP": "Fabric IPv4 of the n-th node of NODES (discovered by check).",
    "CX7_IF": "Fabric netdev of the n-th node of NODES, e.g. enp1s0f0np0 or enP2p1s0f1np1 (discovered by check).",
    "CX7_IB": "RDMA device of the n-th node of NODES, e.g. rocep1s0f0 (discovered by check).",
    "GID_INDEX": "RoCE v2 GID index of the n-th node of NODES (discovered by check; it drifts, never hard-code 3).",
}


def knob_doc(key: str, prefixes: Iterable[str] = ()) -> str | None:
    """A key's one-line doc; `prefixes` are CONTAINER_ENV_PREFIXES as resolved (Settings.container_env_prefixes)."""
    if key in KNOBS:
        return KNOBS[key].doc
    m = RANK_KEY_RE.match(key)
    if m:
        return RANK_KNOB_DOCS[m.group(2)]
    if _passes(key, tuple(prefixes)):
        return PASSTHROUGH_DOC
    if LEGACY_RE.match(key):
        return LEGACY_DOC
    return None


def _passes(key: str, prefixes: tuple[str, ...]) -> bool:
    """Is `key` passed to the containers as it is: a CONTAINER_ENV_PREFIXES family's, and no knob?"""
    return bool(prefixes) and key.startswith(prefixes) and key not in KNOBS and not RANK_KEY_RE.match(key)


# ----------------------------------------------------------------------------------------------
# Resolved values


@dataclass(frozen=True)
class Value:
    key: str
    value: Any
    raw: str
    source: str  # e.g. "recipe glm53-exl3-tp4", "env file env/cluster.env", "environment", "--nodes"

    @property
    def shown(self) -> str:
        """The value for a message: secrets redacted, control characters escaped (one line, always)."""
        if self.raw and (is_secret(self.key) or self.key == "VLLM_EXTRA_ARGS" and names_a_secret_flag(self.raw)):
            return REDACTED
        return repr(self.raw) if _CONTROL_RE.search(self.raw) else self.raw


@dataclass(frozen=True)
class RankPins:
    """Per-rank fabric pins: discovered by `check`, or given as RANK<n>_* knobs."""

    fabric_ip: str | None = None
    netdev: str | None = None
    rdma_dev: str | None = None
    gid_index: int | None = None

    def missing(self) -> list[str]:
        names = {"fabric_ip": "FABRIC_IP", "netdev": "CX7_IF", "rdma_dev": "CX7_IB", "gid_index": "GID_INDEX"}
        return [knob for attr, knob in names.items() if getattr(self, attr) is None]


@dataclass
class Settings:
    values: dict[str, Value]
    recipe: Recipe
    env_file: Path | None
    warnings: list[str] = field(default_factory=list)
    # A replica view (Settings.replica): its index, how many there are, and the position in the full
    # NODES of its rank 0 (its RANK<k>_* pins are read as RANK<rank_offset + k>_*).
    replica_index: int = 0
    replica_count: int = 1
    rank_offset: int = 0

    # -- access
    def get(self, key: str, default: Any = None) -> Any:
        v = self.values.get(key)
        return default if v is None or v.value in (None, "") else v.value

    def source(self, key: str) -> str:
        v = self.values.get(key)
        return v.source if v else "unset"

    def describe(self, key: str) -> str:
        """`KEY=value (from source)` for messages, with secrets redacted."""
        v = self.values.get(key)
        if v is None:
            return f"{key} (unset)"
        return f"{key}={v.shown} (from {v.source})"

    @property
    def nodes(self) -> list[str]:
        return list(self.get("NODES", []))

    @property
    def head(self) -> str:
        """The head: rank 0 of replica 0 (of this replica, in a replica view)."""
        return self.topology.head

    @property
    def topology(self) -> Topology:
        """Replicas → ranks → nodes (topology.py); UsageError, naming the knobs, for a shape that does not fit."""
        replicas = self.get("REPLICAS")
        try:
            return build_topology(self.nodes, self.getint("TP"), int(self.get("GPUS_PER_NODE", 1)),
                                  None if replicas is None else int(replicas), int(self.get("MASTER_PORT", 0)),
                                  first_index=self.replica_index, first_position=self.rank_offset)
        except TopologyError as exc:
            raise UsageError(f"{exc.problem} ({_src(self, *exc.keys)})") from None

    @property
    def service(self) -> Replica:
        """The one service these settings describe: a replica view's replica, or the only replica."""
        topo = self.topology
        if len(topo.replicas) != 1:
            raise UsageError(f"NODES hold {len(topo.replicas)} replicas: this needs one replica's view "
                             "(Settings.replica(i))")
        return topo.replicas[0]

    def replica(self, index: int) -> Settings:
        """Replica `index` as a Settings of its own: NODES are its nodes (rank order), its RANK<k>_* pins are
        the knobs at its nodes' positions in NODES, and it knows its index and the count. The single-service
        code (builders, render, service, orchestrate) runs on it unchanged. One replica: the settings themselves."""
        if self.replica_count > 1:  # already a view: only itself
            if index != 0:
                raise UsageError(f"replica {index} of a replica view (it is replica {self.replica_index})")
            return self
        topo = self.topology
        if not 0 <= index < len(topo.replicas):
            raise UsageError(f"replica {index} does not exist: there are {len(topo.replicas)} "
                             f"(0..{len(topo.replicas) - 1}; {self.describe('REPLICAS')})")
        if len(topo.replicas) == 1:
            return self
        rep = topo.replicas[index]
        values = dict(self.values)
        nodes = values["NODES"]
        values["NODES"] = Value("NODES", list(rep.nodes), " ".join(rep.nodes), f"{nodes.source}, replica {index}")
        values.pop("REPLICAS", None)
        # MASTER_PORT stays as it is: each replica rendezvous on its own head (another host), no clash.
        return replace(self, values=values, replica_index=index, replica_count=len(topo.replicas),
                       rank_offset=rep.offset)

    def replicas(self) -> list[Settings]:
        """Every replica's view, in order (one replica: [self])."""
        return [self.replica(i) for i in range(len(self.topology.replicas))]

    def rank_key(self, rank: int, what: str) -> str:
        """The pin knob of this settings' rank `rank`: RANK<position in the full NODES>_<what>."""
        return f"RANK{self.rank_offset + rank}_{what}"

    @property
    def model(self) -> Path:
        return Path(self.get("MODEL"))

    @property
    def image(self) -> str:
        """IMAGE: the image every rank runs. A recipe that runs a published image names no default: the
        user pins the one they run (ideally by digest), and every command that needs it says so."""
        ref = self.get("IMAGE")
        if ref:
            return str(ref)
        if self.recipe.prebuilt is not None:
            raise UsageError(
                f"IMAGE is not set: recipe {self.recipe.name} runs a prebuilt image ({self.recipe.prebuilt.source}), "
                "not a chain that sparkctl builds",
                fix="set IMAGE=<registry>/<repo>@sha256:<digest> (the published image, pinned by its digest) "
                    "in the env file or the environment")
        raise UsageError(f"IMAGE is not set and recipe {self.recipe.name} names none",
                         fix="set IMAGE in the env file, or add it to the recipe's [defaults]")

    @property
    def cluster_name(self) -> str:
        return str(self.get("CLUSTER_NAME", "sparkctl"))

    def getint(self, key: str) -> int:
        return int(self.get(key))

    def secrets(self) -> dict[str, str]:
        return {k: str(v.value) for k, v in self.values.items() if is_secret(k) and v.value not in (None, "")}

    def vllm_extra_args(self) -> list[str]:
        text = self.get("VLLM_EXTRA_ARGS")
        return parse_vllm_extra_args(str(text)) if text else []

    def container_env_prefixes(self) -> tuple[str, ...]:
        return tuple(self.get("CONTAINER_ENV_PREFIXES") or ())

    def passthrough_env(self) -> dict[str, str]:
        """The keys of CONTAINER_ENV_PREFIXES' families, for every container's environment as they are."""
        prefixes = self.container_env_prefixes()
        return {k: str(v.value) for k, v in self.values.items() if _passes(k, prefixes)}

    def rank_pins(self, rank: int) -> RankPins:
        gid = self.get(self.rank_key(rank, "GID_INDEX"))
        return RankPins(
            fabric_ip=self.get(self.rank_key(rank, "FABRIC_IP")),
            netdev=self.get(self.rank_key(rank, "CX7_IF")),
            rdma_dev=self.get(self.rank_key(rank, "CX7_IB")),
            gid_index=None if gid is None else int(gid),
        )

    def as_dict(self, *, redact: bool = True) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for key in sorted(self.values, key=_sort_key):
            v = self.values[key]
            shown: Any = v.shown if (redact and is_secret(key)) else v.value
            out[key] = {"value": shown, "source": v.source}
        return out


def _sort_key(key: str) -> tuple[int, str]:
    order = list(KNOBS)
    if key in KNOBS:
        return (order.index(key), key)
    m = RANK_KEY_RE.match(key)
    if m:
        return (len(order) + int(m.group(1)), key)
    return (10_000, key)


# ----------------------------------------------------------------------------------------------
# Loading


def _env_file_path(env_file: str | None, environ: Mapping[str, str]) -> tuple[Path | None, bool]:
    """The env file to read, and whether the user named it explicitly (then it must exist)."""
    if env_file:
        return Path(env_file), True
    if environ.get("SPARKCTL_ENV_FILE"):
        return Path(environ["SPARKCTL_ENV_FILE"]), True
    if DEFAULT_ENV_FILE.is_file():
        return DEFAULT_ENV_FILE, False
    return None, False


def known_key(key: str, prefixes: tuple[str, ...] = ()) -> bool:
    """A knob, a rank pin, a seed-launcher switch, or a key of a CONTAINER_ENV_PREFIXES family (`prefixes`)."""
    if not KEY_NAME_RE.fullmatch(key):
        return False
    return key in KNOBS or bool(RANK_KEY_RE.match(key)) or bool(LEGACY_RE.match(key)) or _passes(key, prefixes)


def prefixes_of(raw: str) -> tuple[str, ...]:
    """The valid prefixes of a CONTAINER_ENV_PREFIXES value, as written (validate_settings refuses the others)."""
    return tuple(p for p in raw.split() if _PREFIX_RE.match(p))


def _resolved_prefixes(layers: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """CONTAINER_ENV_PREFIXES from the highest layer that sets it (the layers lowest first), before the rest is
    resolved: which other keys are known depends on it. A bad prefix is validate_settings' to refuse."""
    raw = ""
    for mapping in layers:
        if "CONTAINER_ENV_PREFIXES" in mapping:
            raw = str(mapping["CONTAINER_ENV_PREFIXES"])
    return prefixes_of(raw)


def _read_env_file(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise UsageError(f"env file {path} not found", fix="check the path given by --env-file or SPARKCTL_ENV_FILE")
    broken = [b.original.line for b in _bindings(path) if b.error]
    if broken:  # python-dotenv would skip them, and their keys be unset (a VLLM_API_KEY with a quote left open)
        raise UsageError(f"env file {path} line {', '.join(map(str, broken))}: not KEY=value as python-dotenv reads "
                         "it (a quote left open? a space in the key?); the line is not shown, it may hold a secret")
    try:
        raw = dotenv_values(path, interpolate=False)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"env file {path}: cannot be read ({exc})") from None
    bad = [k for k in raw if not KEY_NAME_RE.fullmatch(k)]
    if bad:  # a quoted key can hold a newline: it would be a line of its own in a rank's env file
        raise UsageError(f"env file {path}: {', '.join(map(repr, bad))} is not a key name (A-Z, 0-9 and '_', "
                         "not starting with a digit)")
    return {k: ("" if v is None else v) for k, v in raw.items()}


def _bindings(path: Path) -> list[Any]:
    """The env file's statements as python-dotenv's own parser reads them (the lines dotenv_values reads)."""
    from dotenv.parser import parse_stream

    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError):
        return []  # _read_env_file says why
    return list(parse_stream(io.StringIO(text)))


def _duplicate_keys(path: Path) -> dict[str, list[int]]:
    """Keys the env file sets more than once, with their line numbers (where the last one silently wins)."""
    lines: dict[str, list[int]] = {}
    for binding in _bindings(path):
        if binding.key is not None:
            lines.setdefault(binding.key, []).append(binding.original.line)
    return {k: v for k, v in lines.items() if len(v) > 1}


# Where a bad value is fixed: the place its line names; `sparkctl config` shows every knob and its source.
_VALUE_FIX = "the knobs and their rules: env/env.tp4.example; `sparkctl config` shows where each value comes from"


def _convert(key: str, raw: str, source: str) -> Any:
    knob = KNOBS.get(key)
    m = RANK_KEY_RE.match(key)
    kind = knob.kind if knob else ("int" if m and m.group(2) == "GID_INDEX" else "str")
    text = raw.strip()
    if kind == "list":
        return text.split()
    if text == "" and kind != "str":
        return None
    if kind == "int":
        try:
            return int(text, 10)
        except ValueError:
            raise UsageError(f"{key}={raw!r} (from {source}) must be a whole number",
                             fix=f"set {key} to a whole number there ({_VALUE_FIX})") from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise UsageError(f"{key}={raw!r} (from {source}) must be a number",
                             fix=f"set {key} to a number there ({_VALUE_FIX})") from None
    return text


def load_settings(
    *,
    env_file: str | None = None,
    cli: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    validate: bool = True,
    strict_keys: bool = False,
) -> Settings:
    """Resolve every knob from the four sources and validate the result.

    strict_keys (commands that change the cluster): an unknown env-file key is a UsageError, not a
    warning: a misspelt MAX_MODEL_LEN must not deploy the default."""
    environ = os.environ if environ is None else environ
    cli = cli or {}
    path, explicit = _env_file_path(env_file, environ)
    file_values: dict[str, str] = {}
    warnings: list[str] = []
    if path is not None and (explicit or path.exists()):
        file_values = _read_env_file(path)
    # The recipe decides the defaults, so find it first, by the same precedence.
    recipe_raw, recipe_src = DEFAULT_RECIPE, "default"
    for src_name, src in ((f"env file {path}", file_values), ("environment", environ), ("command line", cli)):
        if src.get("RECIPE"):
            recipe_raw, recipe_src = src["RECIPE"], src_name
    try:
        recipe = load_recipe(recipe_raw)
    except UsageError as exc:
        raise UsageError(f"{exc.message} (RECIPE from {recipe_src})", fix=exc.fix) from None
    # Which keys are known depends on CONTAINER_ENV_PREFIXES (a recipe may set it): resolve it first.
    recipe_defaults = {k: str(v) for k, v in recipe.defaults.items()}
    prefixes = _resolved_prefixes((recipe_defaults, file_values, environ, cli))
    if path is not None:
        for key in file_values:
            if not known_key(key, prefixes):
                close = difflib.get_close_matches(key, list(KNOBS), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                warnings.append(f"unknown key {key} in env file {path}{hint}; it is ignored")
        if strict_keys and warnings:
            raise UsageError("\n".join(w.replace("; it is ignored", "") for w in warnings),
                             fix="correct or remove the key(s) (check and the commands that change the cluster refuse unknown "
                                 "keys; read-only ones only warn; every knob: env/env.tp4.example)")
        dups = _duplicate_keys(path) if file_values else {}
        if dups:
            said = [f"{key} is set {len(at)} times in env file {path} (lines {', '.join(map(str, at))}): "
                    f"the last one is used" for key, at in sorted(dups.items())]
            if strict_keys:  # which NODES= did the operator mean? the one another operator's file has?
                raise UsageError("\n".join(line.replace(": the last one is used", "") for line in said),
                                 fix="keep one line per key (check and the commands that change the cluster refuse a key set "
                                     "twice; read-only ones only warn)")
            warnings.extend(said)

    values: dict[str, Value] = {}
    layers: list[tuple[str, Mapping[str, Any]]] = [
        (f"recipe {recipe.name}", recipe_defaults),
        (f"env file {path}", file_values),
        ("environment", {k: v for k, v in environ.items() if known_key(k, prefixes)}),
        ("command line", cli),
    ]
    for source, mapping in layers:
        for key, raw in mapping.items():
            if not known_key(key, prefixes):
                if source.startswith("recipe"):
                    raise UsageError(f"{recipe.path}/defaults/{key}: unknown knob")
                continue
            values[key] = Value(key, _convert(key, str(raw), source), str(raw), source)
    values["RECIPE"] = Value("RECIPE", recipe.name, recipe_raw, recipe_src)
    # The bash launcher's LOCAL_MODEL_DIR stands in for MODEL when MODEL is not given.
    if "MODEL" not in values and "LOCAL_MODEL_DIR" in values:
        lmd = values["LOCAL_MODEL_DIR"]
        values["MODEL"] = Value("MODEL", lmd.value, lmd.raw, f"{lmd.source} (LOCAL_MODEL_DIR)")

    settings = Settings(values=values, recipe=recipe, env_file=path if file_values or explicit else None,
                        warnings=warnings)
    if validate:
        try:
            validate_settings(settings)
        except UsageError as exc:  # a misspelt key is often the reason a value looks wrong
            raise UsageError("\n".join([exc.message, *(f"also: {w}" for w in warnings)]), fix=exc.fix) from None
    return settings


def validate_settings(s: Settings) -> None:
    """Raise UsageError with one line per broken rule, each naming the key, value, source and rule."""
    problems: list[str] = []
    for key, knob in KNOBS.items():
        v = s.values.get(key)
        empty = v is None or v.value in (None, "", [])
        if empty:
            default = s.recipe.defaults.get(key)
            if v is not None and knob.kind != "list" and default not in (None, "") and \
                    not v.source.startswith("recipe"):
                # `KEY=` would hide the recipe's value: the code then reads None (DCP= crashed the planner,
                # KV_CACHE_DTYPE= planned a cache of dtype "None")
                how = ("delete the line" if v.source.startswith("env file") else
                       "unset it" if v.source == "environment" else "leave it out")
                problems.append(f"{key} is blank (from {v.source}), which would hide recipe {s.recipe.name}'s "
                                f"{key}={default}: {how} to use it, or give a value")
                continue
            if knob.required:
                where = ("the env file, the environment or with --" + key.lower()) if key in ("NODES", "MODEL") \
                    else "the env file or the environment"
                problems.append(f"{key} is not set: {knob.doc} Set it in {where}")
            continue
        assert v is not None
        value = v.value
        if knob.choices and value not in knob.choices:
            problems.append(f"{s.describe(key)} must be one of: {', '.join(knob.choices)}")
        if knob.minimum is not None and value < knob.minimum:
            problems.append(f"{s.describe(key)} must be at least {knob.minimum:g}")
        if knob.maximum is not None and value > knob.maximum:
            problems.append(f"{s.describe(key)} must be at most {knob.maximum:g}")
        if knob.check:
            rule = knob.check(value)
            if rule:
                problems.append(f"{s.describe(key)} {rule}")
    named = {p.split("=", 1)[0].split(" ", 1)[0] for p in problems}
    for key, v in s.values.items():
        if key in named:  # its knob's own rule already said what is wrong with it
            continue
        if isinstance(v.value, str) and _CONTROL_RE.search(v.value) and not is_secret(key):
            problems.append(f"{key} (from {v.source}) must not contain control characters")
        elif isinstance(v.value, str) and is_secret(key) and re.search(r"[\n\r\x00]", v.value):
            # A secret reaches the containers as one line of an env file; the value is never shown.
            problems.append(f"{key} (from {v.source}) must not contain a newline or NUL (value not shown)")
    if problems:
        raise UsageError("\n".join(dict.fromkeys(problems)), fix=f"change each value as its line says ({_VALUE_FIX})")

    # Rules across knobs.
    tp, dcp = s.getint("TP"), s.getint("DCP")
    if tp % dcp:
        problems.append(f"TP={tp} must be divisible by DCP={dcp} ({_src(s, 'TP', 'DCP')})")
    nodes = s.nodes
    try:
        topo = s.topology
    except UsageError as exc:
        problems.append(exc.message)
    else:
        if len(topo.replicas) > 1 and s.get("MASTER_ADDR"):
            problems.append(f"{s.describe('MASTER_ADDR')} applies to one service, but NODES hold "
                            f"{len(topo.replicas)} replicas ({_src(s, 'NODES', 'TP')}): each replica meets at "
                            "its own head's fabric IP; remove MASTER_ADDR")
    if s.get("PORT") == s.get("MASTER_PORT"):
        problems.append(f"PORT and MASTER_PORT must differ, both are {s.get('PORT')} ({_src(s, 'PORT', 'MASTER_PORT')})")
    method = s.get("SPEC_METHOD")
    if method == "dspark" and not s.get("DSPARK"):
        problems.append(f"SPEC_METHOD=dspark needs DSPARK=<drafter folder> ({_src(s, 'SPEC_METHOD')})")
    if s.get("DSPARK") and method != "dspark":
        problems.append(f"DSPARK is set but SPEC_METHOD={method}: set SPEC_METHOD=dspark to use the drafter "
                        f"({_src(s, 'DSPARK', 'SPEC_METHOD')})")
    if method == "dspark" and not s.recipe.dspark_speculative_config:
        problems.append(f"recipe {s.recipe.name} has no DSpark drafter configuration (SPEC_METHOD=dspark)")
    for key in s.values:
        m = RANK_KEY_RE.match(key)
        if not m:
            continue
        rank, what = int(m.group(1)), m.group(2)
        value = s.values[key].value
        if rank >= len(nodes):  # numbered by position in NODES, whatever the replicas
            problems.append(f"{s.describe(key)}: there is no rank {rank} with {len(nodes)} nodes")
        elif value in (None, ""):
            continue
        elif what == "FABRIC_IP" and _ipv4(value):
            problems.append(f"{s.describe(key)} must be an IPv4 address")
        elif what in ("CX7_IF", "CX7_IB") and not _NETDEV_RE.match(str(value)):
            problems.append(f"{s.describe(key)} must be a device name (letters, digits, '_.:-', ≤ 15)")
        elif what == "GID_INDEX" and int(value) < 0:
            problems.append(f"{s.describe(key)} must be 0 or more")
    if problems:
        raise UsageError("\n".join(problems), fix=f"change each value as its line says ({_VALUE_FIX})")


def _src(s: Settings, *keys: str) -> str:
    """'TP from recipe x, DCP from env file y' — or one source when all agree."""
    sources = {k: s.source(k) for k in keys}
    if len(set(sources.values())) == 1:
        return f"from {next(iter(sources.values()))}"
    return ", ".join(f"{k} from {src}" for k, src in sources.items())
