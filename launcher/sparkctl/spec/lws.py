"""Kubernetes manifests for the service `up` runs over SSH: one LeaderWorkerSet and the API's Service.

Pure: Settings and the per-rank `RankSpec`s (builders.rank_specs) in, plain dicts out; `manifests_yaml`
serialises them. API: LeaderWorkerSet `leaderworkerset.x-k8s.io/v1`
(kubernetes-sigs/lws, api/leaderworkerset/v1/leaderworkerset_types.go).

What maps to what (README, "Kubernetes (LeaderWorkerSet)"):

- A group = one TP group: the leader is rank 0 (the API), the workers are the headless ranks;
  `leaderWorkerTemplate.size` = the ranks of one group. N groups are `spec.replicas` of ONE LeaderWorkerSet,
  not N objects: the groups then share one template (one rollout, group by group), one Service spreads
  requests over every group's leader, and the LWS scale subresource (HPA) changes N. `render_lws` takes
  `replicas`; `render --target lws` passes the topology's REPLICAS.
- The argv is `builders.vllm_serve_argv`'s, word for word, except two values Kubernetes fills in:
  `--master-addr $(LWS_LEADER_ADDRESS)` (the leader pod's in-cluster name, which LWS puts in every
  container's env) and, in the one worker template, `--node-rank $(LWS_WORKER_INDEX)` (1..size-1: LWS's
  worker index is the rank). Kubernetes expands `$(NAME)` in args and env values, so every other `$(` is
  written `$$(` (its escape) and reaches vLLM unchanged.
- Env: `builders.rank_env`, except VLLM_HOST_IP (a node's fabric IP: a pod may land on any node, so it is
  the pod's own IP, from the downward API) and the secrets, which are `secretKeyRef`s into one Secret
  (`<lws name>-secrets`, one key per variable) that the user creates: no value is ever written here.
- NIC pins: an LWS pod can land on any node and LWS has no per-rank node selector, so NCCL_SOCKET_IFNAME,
  GLOO_SOCKET_IFNAME, NCCL_IB_HCA and NCCL_IB_GID_INDEX go into the one template as values; rendering is
  refused (exit 2) when the ranks' netdev, RDMA device or GID index differ.
- Not carried, said in the pod annotations: ulimits (Kubernetes has no per-pod rlimits: the node's
  container runtime sets them) and devices (/dev/infiniband needs the cluster's RDMA device plugin).
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from ..errors import UsageError
from .builders import (
    LABEL_CLUSTER,
    LABEL_CONFIG_HASH,
    LABEL_RECIPE,
    RankSpec,
    api_bind_host,
)
from .settings import Settings, is_secret

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # LWS sets it in every container of a group
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"  # 0 for the leader, 1..size-1 for the workers
LABEL_LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
ANNOTATION_PREFIX = "sparkctl"
CONTAINER = "vllm"
NODE_LOCAL_ENV = "VLLM_HOST_IP"
# The pins every pod gets as they are (RankPins attribute, its knob).
UNIFORM_PINS = (("netdev", "CX7_IF"), ("rdma_dev", "CX7_IB"), ("gid_index", "GID_INDEX"))
# Names: the LWS name prefixes its StatefulSets (`<name>-<group>`), whose pods carry a
# `<statefulset>-<10-char hash>` label value (at most 63): 40 leaves room for the group index and the Service.
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_SIZE_UNITS = {"": "", "b": "", "k": "Ki", "m": "Mi", "g": "Gi"}  # docker's --shm-size units are binary
DEFAULT_READY_TIMEOUT_S = 3600

# The readiness check `wait` makes, inside the leader's container (python3 is in every vLLM image): the
# served name in /v1/models and one real chat completion. Values arrive as argv, the key from the env;
# no proxy from the pod's environment is used (the key goes to the engine only).
READINESS_SCRIPT = """\
import json, os, sys, urllib.request
name, base = sys.argv[1], sys.argv[2]
headers = {"Content-Type": "application/json"}
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the key never goes to a proxy
if os.environ.get("VLLM_API_KEY"):
    headers["Authorization"] = "Bearer " + os.environ["VLLM_API_KEY"]
def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers)
    with direct.open(req, timeout=50) as answer:
        return json.loads(answer.read(4 << 20))
if name not in [m.get("id") for m in call("/v1/models").get("data") or []]:
    sys.exit(name + " is not in /v1/models")
chat = {"model": name, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
if not call("/v1/chat/completions", chat).get("choices"):
    sys.exit("no chat completion")
"""


def lws_name(settings: Settings) -> str:
    name = settings.cluster_name
    if not _NAME_RE.match(name):
        raise UsageError(f"{settings.describe('CLUSTER_NAME')} cannot name Kubernetes objects (a DNS-1035 "
                         "label: lower-case letters, digits and '-', starting with a letter, at most 40 here)",
                         fix="set CLUSTER_NAME to such a name for `render --target lws`")
    return name


def secret_name(settings: Settings) -> str:
    return f"{lws_name(settings)}-secrets"


def model_volume_source(settings: Settings) -> dict[str, Any]:
    """LWS_MODEL_VOLUME: `hostpath` (MODEL at the same path on every node) or `pvc:<claim>`."""
    raw = str(settings.get("LWS_MODEL_VOLUME") or "hostpath")
    if raw == "hostpath":
        return {"hostPath": {"path": str(settings.model), "type": "Directory"}}
    if raw.startswith("pvc:"):
        return {"persistentVolumeClaim": {"claimName": raw[4:], "readOnly": True}}
    raise UsageError(f"{settings.describe('LWS_MODEL_VOLUME')} must be hostpath or pvc:<claim>")


def k8s_quantity(size: str) -> str:
    """docker's --shm-size (64g, 512m, 1024) as a Kubernetes quantity (64Gi, 512Mi, 1024)."""
    m = re.fullmatch(r"([0-9]+)([bkmg]?)", size.strip().lower())
    if not m:
        raise UsageError(f"SHM_SIZE={size!r} is not a size like 64g")
    return m.group(1) + _SIZE_UNITS[m.group(2)]


def escape(text: str) -> str:
    """Kubernetes expands `$(NAME)` in args and env values; `$$(` is its escape for a literal `$(`."""
    return text.replace("$(", "$$(")


def require_uniform_pins(settings: Settings, specs: list[RankSpec]) -> None:
    """Every rank of every replica (specs of all replicas, `settings` the full settings) pins alike."""
    topo = settings.topology

    def key(spec: RankSpec, knob: str) -> str:  # the knob's name in the env file: RANK<position in NODES>
        return f"RANK{topo.locate(spec.node)[1].position}_{knob}"

    head = specs[0]
    diffs = [
        f"{key(s, knob)}={getattr(s.pins, attr)} ({s.node}) differs from "
        f"{key(head, knob)}={getattr(head.pins, attr)}"
        for s in specs[1:] for attr, knob in UNIFORM_PINS if getattr(s.pins, attr) != getattr(head.pins, attr)
    ]
    if diffs:
        raise UsageError(
            "a LeaderWorkerSet cannot pin NICs per rank (its pods may land on any node and share one worker "
            "template), so every node's fabric NIC must have the same names: " + "; ".join(diffs),
            fix="give the fabric port the same netdev/RDMA name and GID index on every node (udev names, the "
                "same port cabled), or serve with `sparkctl up`, which pins each rank on its own node")


def container_argv(spec: RankSpec, *, worker: bool) -> list[str]:
    """The rank's `vllm serve` argv with the leader's address (and a worker's rank) left to Kubernetes."""
    argv = spec.vllm_argv
    out = [escape(word) for word in argv]
    out[argv.index("--master-addr") + 1] = f"$({LEADER_ADDRESS_ENV})"
    if worker:
        out[argv.index("--node-rank") + 1] = f"$({WORKER_INDEX_ENV})"
    return out


def container_env(settings: Settings, env: dict[str, str]) -> list[dict[str, Any]]:
    secret = secret_name(settings)
    out: list[dict[str, Any]] = []
    for key in sorted(env):
        if key == NODE_LOCAL_ENV:
            out.append({"name": key, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        elif is_secret(key):
            out.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
        else:
            out.append({"name": key, "value": escape(env[key])})
    return out


def _volumes(settings: Settings) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the model and its companions read-only at their own paths, /dev/shm in memory."""
    volumes: list[dict[str, Any]] = [{"name": "model", **model_volume_source(settings)}]
    mounts: list[dict[str, Any]] = [{"name": "model", "mountPath": str(settings.model), "readOnly": True}]
    extra = [("dspark", settings.get("DSPARK")), ("ablit", settings.get("ABLIT_HOST_DIR")),
             *((f"mount-{i}", path) for i, path in enumerate(settings.recipe.container.mounts))]
    for name, path in extra:
        if path:
            volumes.append({"name": name, "hostPath": {"path": str(path), "type": "Directory"}})
            mounts.append({"name": name, "mountPath": str(path), "readOnly": True})
    shm = k8s_quantity(str(settings.get("SHM_SIZE")))
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _ready_timeout_s(settings: Settings) -> int:
    raw = settings.recipe.container.env.get("VLLM_ENGINE_READY_TIMEOUT_S")
    try:
        return max(60, int(float(raw))) if raw else DEFAULT_READY_TIMEOUT_S
    except ValueError:
        return DEFAULT_READY_TIMEOUT_S


def leader_probes(settings: Settings) -> dict[str, Any]:
    """`wait`'s three answers as probes. startup: /health within the engine's own load timeout (a 78 GB
    load outlasts any liveness budget); liveness: /health (the process answers; cheap); readiness: the
    served name listed and a real one-token chat completion, as `wait` demands, which an httpGet cannot
    say (it reads no body and sends no POST), so an exec of python3 in the container."""
    port = settings.getint("PORT")
    host = api_bind_host(settings)
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    health = {"httpGet": {"path": "/health", "port": port, "scheme": "HTTP"}}
    period = 10
    return {
        "startupProbe": {**health, "periodSeconds": period, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(_ready_timeout_s(settings) / period) + 1},
        "livenessProbe": {**health, "periodSeconds": period, "timeoutSeconds": 5, "failureThreshold": 6},
        "readinessProbe": {
            "exec": {"command": ["python3", "-c", READINESS_SCRIPT, str(settings.get("SERVED_MODEL_NAME")),
                                 f"http://{local}:{port}"]},
            "periodSeconds": 30, "timeoutSeconds": 110, "failureThreshold": 3, "successThreshold": 1,
        },
    }


def pod_template(settings: Settings, spec: RankSpec, cfg_hash: str, *, worker: bool) -> dict[str, Any]:
    c = settings.recipe.container
    gpus = int(settings.get("GPUS_PER_NODE", 1))
    volumes, mounts = _volumes(settings)
    entrypoint, *args = container_argv(spec, worker=worker)
    env = {k: v for k, v in spec.env.items()}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": settings.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [entrypoint],  # docker's --entrypoint vllm: whatever ENTRYPOINT the image declares
        "args": args,
        "env": container_env(settings, env),
        "resources": {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}},
        "volumeMounts": mounts,
    }
    if not worker:
        container["ports"] = [{"name": "http", "containerPort": settings.getint("PORT"), "protocol": "TCP"}]
        container.update(leader_probes(settings))
    if c.cap_add:
        container["securityContext"] = {"capabilities": {"add": list(c.cap_add)}}
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if c.network == "host":  # the fabric NICs are the node's: the pods use the node's network
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"  # LWS_LEADER_ADDRESS is a cluster DNS name
    if c.ipc == "host":
        pod["hostIPC"] = True
    nofile, memlock = settings.getint("ULIMIT_NOFILE"), settings.getint("ULIMIT_MEMLOCK")
    annotations = {
        f"{ANNOTATION_PREFIX}/rank": "1..size-1 (LWS_WORKER_INDEX)" if worker else "0",
        f"{ANNOTATION_PREFIX}/ulimits": f"nofile={nofile}:{nofile} memlock={memlock}:{memlock} (not set by "
                                        "Kubernetes: the node's container runtime must give them)",
    }
    if c.devices:
        annotations[f"{ANNOTATION_PREFIX}/devices"] = (" ".join(c.devices) + " (not mounted: the cluster's RDMA "
                                                       "device plugin must give them)")
    return {"metadata": {"labels": labels(settings, cfg_hash), "annotations": annotations}, "spec": pod}


def labels(settings: Settings, cfg_hash: str) -> dict[str, str]:
    return {LABEL_CLUSTER: settings.cluster_name, LABEL_RECIPE: settings.recipe.name, LABEL_CONFIG_HASH: cfg_hash}


def _same_workers(settings: Settings, specs: list[RankSpec], cfg_hash: str) -> dict[str, Any]:
    """The one worker template; every worker rank must render to it (LWS has no per-rank template)."""
    templates = [pod_template(settings, s, cfg_hash, worker=True) for s in specs[1:]]
    for s, t in zip(specs[2:], templates[1:], strict=True):
        if t != templates[0]:
            raise UsageError(f"rank {s.rank} ({s.node}) renders another pod than rank 1: a LeaderWorkerSet has "
                             "one worker template", fix="make every worker's settings the same")
    return templates[0]


def render_lws(settings: Settings, specs: list[RankSpec], cfg_hash: str, *, replicas: int = 1) -> list[dict[str, Any]]:
    """[LeaderWorkerSet, Service]: `replicas` groups of len(specs) pods each, one Service over every leader."""
    if replicas < 1:
        raise UsageError(f"replicas must be at least 1, not {replicas}")
    name = lws_name(settings)
    require_uniform_pins(settings, specs)
    leader = pod_template(settings, specs[0], cfg_hash, worker=False)
    lwt: dict[str, Any] = {"size": len(specs), "restartPolicy": "RecreateGroupOnPodRestart"}
    if len(specs) > 1:
        lwt["leaderTemplate"] = leader
        lwt["workerTemplate"] = _same_workers(settings, specs, cfg_hash)
    else:  # a group of one: the leader is made from the worker template
        lwt["workerTemplate"] = leader
    lws = {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "labels": labels(settings, cfg_hash)},
        "spec": {
            "replicas": replicas,
            # Workers start once the leader pod exists, not once it is ready: the leader is ready only when
            # every rank has joined (LeaderReady would wait for ever).
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": lwt,
        },
    }
    port = settings.getint("PORT")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-api", "labels": labels(settings, cfg_hash)},
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_LWS_NAME: name, LABEL_WORKER_INDEX: "0"},
            "ports": [{"name": "http", "protocol": "TCP", "port": port, "targetPort": port}],
        },
    }
    return [lws, service]


def secret_keys(settings: Settings) -> list[str]:
    """The keys the Secret must hold (names only)."""
    return sorted(settings.secrets())


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # a shared dict is written out again, never as &id/*id
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def manifests_yaml(settings: Settings, docs: list[dict[str, Any]], cfg_hash: str) -> str:
    keys = secret_keys(settings)
    head = [
        f"# sparkctl render --target lws (config hash {cfg_hash}); needs the LeaderWorkerSet controller",
        f"# ({LWS_API_VERSION}). Apply: kubectl apply -f THIS_FILE",
    ]
    if keys:
        literals = " ".join(f"--from-literal={k}=..." for k in keys)
        head.append("# First create the Secret (values from your env file; never written here):")
        head.append(f"#   kubectl create secret generic {secret_name(settings)} {literals}")
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
    return "\n".join(head) + "\n" + body
