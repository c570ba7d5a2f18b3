"""`sparkctl check`'s rules: pure functions that turn node facts into findings.

Each rule takes facts in and gives `Finding`s out, each with a status (✓ ok, ✗ fail, ! warn), a short
cell text for the table, a full reason and a one-line fix; `evaluate` runs every round-1 rule over the
gathered facts. Nothing here runs anything on a node: the flow that gathers the facts (one SSH
connection per node, two round trips) and returns a `CheckReport` is `orchestrate/check.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..errors import NodeError
from ..facts import docker_parse as D
from ..facts import node_facts as F
from ..spec.planner import (
    GB,
    GIB,
    Plan,
    gb,
)
from ..spec.settings import RankPins
from . import memory
from .findings import CLUSTER_ROW, FAIL, OK, PIN_ENV, SKIP, WARN, Finding, Needs
from .findings import finding as _f
from .findings import unknown as _unknown
from .nic_pins import discover_fabric
from .parity import rule_parity

# Column order of the table; every node gets one finding per column.
CHECKS = (
    "ssh",
    "docker",
    "gpu",
    "memory",
    "limits",
    "fabric",
    "reach",
    "ports",
    "disk",
    "model",
    "image",
    "containers",
    "plan",
    "parity",
    "argv",
)

DISK_FAIL_BYTES = 10 * GB  # below this the image chain cannot even be unpacked
DISK_WARN_BYTES = 50 * GB  # a production chain (vLLM + CUDA) is tens of GB per rank
DF_PATHS = (F.DOCKER_ROOT,)  # the engine says where its data root is (DockerRootDir); MODEL is added


# -------------------------------------------------------------------------------- per-node rules


def rule_ssh(node: str, error: NodeError | None) -> Finding:
    if error is None:
        return _f(node, "ssh", OK, "ok")
    short = {
        "hostkey-unknown": "unknown host key",
        "hostkey-changed": "HOST KEY CHANGED",
        "hostkey-revoked": "revoked host key",
        "hostkey-cert": "host certificate refused",
        "proxy": "ProxyCommand failed",
        "unsupported": "unsupported key",
        "refused": "refused",
        "timeout": "timeout",
        "auth": "auth failed",
        "dns": "no such host",
    }.get(error.kind, error.kind)
    fix = error.fix or f"check that `ssh {node} true` works from here, then run check again"
    return _f(node, "ssh", FAIL, short, error.message, fix)


def rule_docker(node: str, facts: F.NodeFacts) -> Finding:
    v = facts.docker
    if v is None or v.server_version is None:
        why = facts.problems.get("docker-version", "no answer")
        return _f(
            node,
            "docker",
            FAIL,
            "engine down",
            f"{node}: the Docker engine is not reachable: {why}",
            f"start the Docker engine on {node} (`systemctl start docker`) and check DOCKER_HOST there",
        )
    if v.api_version and _version_tuple(v.api_version) < (1, 40):
        return _f(
            node,
            "docker",
            FAIL,
            f"API {v.api_version}",
            f"{node}: Docker API {v.api_version} is too old for --gpus (needs 1.40, engine 19.03+)",
            f"upgrade Docker on {node}",
        )
    return _f(node, "docker", OK, v.server_version)


def _version_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(".")[:3])
    except ValueError:
        return (0,)


def rule_gpu(node: str, facts: F.NodeFacts, needs: Needs, head: F.NodeFacts | None = None) -> Finding:
    """GPUs present, with name, driver and CUDA version. Only the head is asked for the CUDA version
    (plain `nvidia-smi`): it follows from the driver, so a rank on the head's driver has the head's;
    a rank on another driver is a warning (ranks of one service should run the same driver)."""
    if not facts.gpus:
        why = facts.problems.get("gpu", "nvidia-smi listed no GPU")
        return _f(
            node,
            "gpu",
            FAIL,
            "no GPU",
            f"{node}: no GPU found: {why}",
            f"install the NVIDIA driver on {node} and check that `nvidia-smi` works there",
        )
    gpu = facts.gpus[0]
    head_gpu = head.gpus[0] if head is not None and head is not facts and head.gpus else None
    cuda = facts.gpu_banner.cuda_version if facts.gpu_banner else None
    if cuda is None and head_gpu is not None and head_gpu.driver_version == gpu.driver_version:
        cuda = head.gpu_banner.cuda_version if head is not None and head.gpu_banner else None
    desc = f"{gpu.name} ×{len(facts.gpus)}, driver {gpu.driver_version}" + (f", CUDA {cuda}" if cuda else "")
    if len(facts.gpus) < needs.gpus_per_node:
        return _f(
            node,
            "gpu",
            FAIL,
            f"{len(facts.gpus)} GPU(s)",
            f"{node}: {desc}; GPUS_PER_NODE is {needs.gpus_per_node}",
            f"check {node}'s GPUs with nvidia-smi, or lower GPUS_PER_NODE",
        )
    if head_gpu is not None and head_gpu.driver_version != gpu.driver_version:
        return _f(
            node,
            "gpu",
            WARN,
            f"driver {gpu.driver_version}",
            f"{node}: {desc}; the head runs driver {head_gpu.driver_version}",
            f"install the head's driver ({head_gpu.driver_version}) on {node}: ranks of one service should match",
        )
    return _f(node, "gpu", OK, (gpu.name or "GPU").replace("NVIDIA ", ""), f"{node}: {desc}")


DROP_CACHES_BY_HAND = "sync; echo 3 > /proc/sys/vm/drop_caches"
SWAP_WARN_BYTES = 1 * GIB  # a few MB swapped out is normal; a GB on a serving node slows it and hides a squeeze


def rule_memory(node: str, facts: F.NodeFacts, plan: Plan | None = None, needs: Needs | None = None) -> Finding:
    """What the engine can get on this node now, against what the plan needs there (per rank total x
    GPUS_PER_NODE). Unified memory (a GB10: nvidia-smi reports no memory.total): MemFree is what it
    gets now; the page cache (Cached − Shmem + Buffers + SReclaimable) only once dropped (WARN: the
    field's NV_ERR_NO_MEMORY after the weights load); anything else -- other processes, other GPU
    contexts -- is held (FAIL, naming the GPU processes). Discrete GPUs: the other GPU processes'
    memory against the GPU's. This cluster's own containers are given back by `up`: not counted. A
    live GPU process of anyone else (memory.foreign) is a FAIL whatever the numbers: `up` refuses
    to start next to it; one that has ended is memory on its way back (`up` waits for it)."""
    m = facts.meminfo
    if m is None:
        return _unknown(node, "memory", facts, "meminfo")
    ours = {c.id: c.names for c in facts.containers or []}  # docker-ps lists this cluster's alone
    apps = facts.gpu_apps or []
    cluster = needs.cluster if needs else ""
    mine = [a for a in apps if not a.ended and (a.container_id in ours or (cluster and a.container_cluster == cluster))]
    others = memory.foreign(apps, cluster, ours) if cluster else [a for a in apps if not a.ended and a not in mine]
    ending = [a for a in apps if a.ended]
    ours_running = any(c.state == "running" for c in facts.containers or [])
    unified = memory.unified(facts)
    cache = m.cache_bytes or 0
    free = m.free_bytes if m.free_bytes is not None else m.available_bytes
    parts = [f"MemTotal {gb(m.total_bytes)}"]
    if free is not None:
        parts.append(f"{gb(free)} free")
    if m.cache_bytes is not None:
        parts.append(f"{gb(cache)} page cache")
    if m.available_bytes is not None:
        parts.append(f"{gb(m.available_bytes)} available")
    if others:
        parts.append(f"other GPU processes: {memory.describe(others)}")
    if ending:
        parts.append(f"not yet given back: {memory.describe(ending)}")
    if facts.gpu_apps is None:
        parts.append(f"other GPU processes unknown ({facts.problems.get('gpu-apps', 'not reported')})")
    numbers = ", ".join(parts)
    warnings: list[str] = []
    if m.swap_used_bytes is not None and m.swap_used_bytes >= SWAP_WARN_BYTES:
        warnings.append(f"{gb(m.swap_used_bytes)} of swap in use (memory was short here; a serving node "
                        "that swaps stalls, and the engine's memory cannot be swapped)")
    fix_others = memory.foreign_fix(node, others) if others else (
                  f"free memory on {node}: see what holds it (ps aux --sort=-rss | head; nvidia-smi)")
    if others:  # up refuses to start next to a process it did not start (memory.foreign): so does check
        return _f(node, "memory", FAIL, "other GPU processes",
                  f"{node}: GPU memory is held by {memory.describe(others)}: `up` refuses to start next to it "
                  f"({numbers})", fix_others)
    if plan is None or free is None:
        short = gb(m.total_bytes)
        why = "" if plan is not None else " (not judged: no memory plan, see the plan row)"
        if warnings:
            return _f(node, "memory", WARN, "swap in use", f"{node}: {numbers}; " + "; ".join(warnings),
                      f"find what pushed {node} into swap and stop it")
        return _f(node, "memory", OK, short, f"{node}: {numbers}{why}")
    need = plan.per_rank_total * (needs.gpus_per_node if needs else 1)
    given_back = sum(a.used_bytes or 0 for a in mine)
    if unified:
        have = free + given_back
        short = f"{gb(need)}/{gb(have)} free"
        if need > have + cache:
            held = "held by other processes (no other GPU process)"
            text = (f"{node}: the plan needs {gb(need)} here but only {gb(have)} is free and {gb(cache)} page "
                    f"cache could be dropped ({numbers}); the rest is {held}")
            if ours_running and not mine:
                return _f(node, "memory", WARN, short, text + "; this cluster's engine runs here and holds "
                          "memory nvidia-smi does not itemize: judged again when up has stopped it",
                          fix_others)
            if ending:
                return _f(node, "memory", WARN, short, text + "; processes that have ended still hold memory: "
                          "up waits for it to come back (MEMORY_WAIT_S)", fix_others)
            return _f(node, "memory", FAIL, short, text, fix_others)
        if need > have:
            return _f(node, "memory", WARN, f"{short} (cache {gb(cache)})",
                      f"{node}: the plan needs {gb(need)} here and only {gb(have)} is free: it fits only after "
                      f"dropping the {gb(cache)} page cache, which a GB10 does not give CUDA back in time "
                      f"(the KV cache allocation fails after the weights load: NV_ERR_NO_MEMORY / OOM) "
                      f"({numbers})",
                      f"drop the page cache on {node} as root: {DROP_CACHES_BY_HAND} (`up` drops it before "
                      "starting on a GB10 unless DROP_CACHES=0; DROP_CACHES=1 on any node)")
    else:
        gpu_total = min((g.memory_total_mib or 0) for g in facts.gpus or []) * 1024 * 1024 if facts.gpus else 0
        short = f"{gb(need)}/{gb(gpu_total)} GPU" if gpu_total else gb(m.total_bytes)
    if warnings:
        return _f(node, "memory", WARN, "swap in use", f"{node}: {numbers}; " + "; ".join(warnings),
                  f"find what pushed {node} into swap and stop it")
    return _f(node, "memory", OK, short, f"{node}: {numbers}; the plan needs {gb(need)} here")


def rule_fabric_record(node: str, facts: F.NodeFacts) -> Finding | None:
    """The ports as `sparkctl setup` left them (its fabric document on the node) against what the node has
    now: a port gone, down, with another address or MAC is a failure naming the port. None: no document
    (setup never ran there), or every port as recorded."""
    doc = facts.fabric_record
    ports = doc.get("ports") if isinstance(doc, dict) else None
    mine = ports.get(node) if isinstance(ports, dict) else None
    if not isinstance(mine, dict) or facts.netdevs is None:
        return None
    live = {d.name: d for d in facts.netdevs}
    wrong = []
    for port, rec in sorted(mine.items()):
        rec = rec if isinstance(rec, dict) else {}
        addr, mac, peers = rec.get("address"), rec.get("mac"), rec.get("peers")
        cable = f" (cabled to {', '.join(str(p) for p in peers)})" if isinstance(peers, list) and peers else ""
        d = live.get(str(port))
        if d is None:
            wrong.append(f"port {port}{cable} is gone")
        elif not d.is_up:
            wrong.append(f"port {port}{cable} is down")
        elif isinstance(addr, str) and addr not in {str(a) for a in d.ipv4}:
            have = ", ".join(str(a) for a in d.ipv4) or "none"
            wrong.append(f"port {port} has address {have}, not {addr} as setup set it")
        elif isinstance(mac, str) and d.mac and d.mac.lower() != mac.lower():
            wrong.append(f"port {port}'s MAC is {d.mac}, not {mac} as setup found it (another card?)")
    if not wrong:
        return None
    return _f(node, "fabric", FAIL, wrong[0][:60], f"{node}: " + "; ".join(wrong) + " (against the fabric document "
              "`sparkctl setup` left)", "re-seat or move back the cable, or run `sparkctl setup` to set up the "
              "fabric as it is cabled now (it plans first)")


def with_fabric_record(fabric: Finding, recorded: Finding | None) -> Finding:
    """The fabric row when setup's document disagrees with the node: the document's finding (the port, its cable,
    `sparkctl setup` as the fix), with what the discovery also found wrong after it; else the discovery's."""
    if recorded is None:
        return fabric
    if fabric.status == FAIL and fabric.reason not in recorded.reason:
        return replace(recorded, reason=f"{recorded.reason}; {fabric.reason}")
    return recorded


def rule_limits(node: str, facts: F.NodeFacts, needs: Needs) -> Finding:
    if facts.nofile_hard is None or facts.memlock_hard_kib is None:
        return _unknown(node, "limits", facts, "nofile" if facts.nofile_hard is None else "memlock")
    problems = []
    if facts.nofile_hard < needs.nofile:
        problems.append(
            f"hard nofile limit {F.format_limit(facts.nofile_hard)} < ULIMIT_NOFILE={needs.nofile} "
            '(NCCL fails at 4 ranks with "Too many open files"; docker refuses --ulimit above it)'
        )
    have_memlock = F.UNLIMITED if facts.memlock_hard_kib >= F.UNLIMITED else facts.memlock_hard_kib * 1024
    want_memlock = F.UNLIMITED if needs.memlock_bytes < 0 else needs.memlock_bytes
    if have_memlock < want_memlock:
        want = "unlimited" if needs.memlock_bytes < 0 else f"{needs.memlock_bytes} B"
        problems.append(
            f"hard memlock limit {F.format_limit(facts.memlock_hard_kib)} KiB < ULIMIT_MEMLOCK ({want}) "
            "(RDMA needs locked memory)"
        )
    short = f"nofile {F.format_limit(facts.nofile_hard)}, memlock {F.format_limit(facts.memlock_hard_kib)}"
    if problems:
        return _f(
            node,
            "limits",
            FAIL,
            "too low",
            f"{node}: " + "; ".join(problems),
            f"raise the hard limits on {node} (limits.conf and LimitNOFILE=/LimitMEMLOCK=infinity in "
            "docker.service), or lower ULIMIT_NOFILE/ULIMIT_MEMLOCK in the env file",
        )
    return _f(node, "limits", OK, short)


def rule_reach(node: str, outcome: Mapping[str, str] | NodeError | None, peers: Mapping[str, str]) -> Finding:
    """outcome: peer IP -> "ok" or the failure; peers: peer IP -> peer node name."""
    if outcome is None:
        return _f(node, "reach", SKIP, "-", f"{node}: not tested (its own fabric address is unknown)")
    if isinstance(outcome, NodeError):
        fix = outcome.fix or f"run check again; if it repeats, run the reach test on {node} by hand: {REACH_BY_HAND}"
        return _f(node, "reach", FAIL, "probe failed", outcome.message, fix)
    bad = {ip: why for ip, why in outcome.items() if why != "ok"}
    untested = [ip for ip in peers if ip not in outcome]
    if bad:
        names = ", ".join(f"{peers.get(ip, ip)} ({ip}: {why})" for ip, why in bad.items())
        return _f(
            node,
            "reach",
            FAIL,
            f"{len(bad)} unreachable",
            f"{node} cannot reach {names} over the fabric",
            "check the fabric links, addresses and netmasks of both ends (and any firewall on them)",
        )
    if untested:
        return _f(
            node, "reach", WARN, "not tested", f"{node}: no reachability result for {', '.join(untested)}"
        )
    return _f(node, "reach", OK, f"{len(outcome)} peers" if outcome else "no peers")


def rule_ports(node: str, facts: F.NodeFacts, needs: Needs, *, is_head: bool) -> Finding:
    if not is_head:  # the ranks connect to the head's ports; nothing listens on a fixed port elsewhere
        return _f(node, "ports", OK, "-")
    if facts.listeners is None:
        return _unknown(node, "ports", facts, "listening")
    wanted = {needs.port: "PORT (the API)", needs.master_port: "MASTER_PORT (rendezvous)"}
    taken = F.ports_in_use(facts.listeners, wanted)
    if taken:
        what = ", ".join(f"{p} {wanted[p]}" for p in taken)
        return _f(
            node,
            "ports",
            FAIL,
            f"{', '.join(map(str, taken))} taken",
            f"{node}: something already listens on {what}",
            f"find it with `ss -ltnp 'sport = :{taken[0]}'` on {node} and stop it (a previous "
            "sparkctl service: `sparkctl down`), or choose another PORT/MASTER_PORT",
        )
    return _f(node, "ports", OK, "free")


def rule_disk(node: str, facts: F.NodeFacts) -> Finding:
    """Free space where the engine keeps images (its DockerRootDir, as it says), and on MODEL's
    filesystem (named, for the record). Without the engine's answer: the fullest filesystem measured."""
    if not facts.disks:
        return _unknown(node, "disk", facts, "df")
    paths = facts.disk_paths or []
    roles = dict(zip([p.asked for p in paths], zip(paths, facts.disks, strict=False), strict=False))
    root = roles.get(F.DOCKER_ROOT)
    if root is not None:
        d = root[1]
        desc = f"{gb(d.available_bytes)} free on {d.mountpoint} (the Docker data root {root[0].path})"
    else:
        d = min(facts.disks, key=lambda x: x.available_bytes)
        why = facts.problems.get("disk-paths") or "the engine did not say"
        desc = f"{gb(d.available_bytes)} free on {d.mountpoint} (DockerRootDir unknown: {why})"
    model = [(p, u) for a, (p, u) in roles.items() if a != F.DOCKER_ROOT]
    if model:
        p, u = model[0]
        desc += f"; MODEL {p.path}: {gb(u.available_bytes)} free on {u.mountpoint}"
    if d.available_bytes < DISK_FAIL_BYTES:
        return _f(
            node,
            "disk",
            FAIL,
            gb(d.available_bytes),
            f"{node}: only {desc} for images",
            f"free space on {node}: a lower BUILD_KEEP_CHAINS keeps fewer chains at the next `sparkctl build`; remove "
            "images you no longer need there by name (`docker image ls`, `docker rmi NAME`) — the chain needs tens of GB",
        )
    if d.available_bytes < DISK_WARN_BYTES:
        return _f(
            node,
            "disk",
            WARN,
            gb(d.available_bytes),
            f"{node}: {desc}; a production image chain needs ~{DISK_WARN_BYTES // GB} GB",
            f"free space on {node} before `sparkctl build`",
        )
    return _f(node, "disk", OK, gb(d.available_bytes), f"{node}: {desc}")


def rule_identity(nodes: Sequence[str], machine_ids: Mapping[str, str | None],
                  hostnames: Mapping[str, str]) -> list[Finding]:
    """Two nodes with one /etc/machine-id are one machine (or clones that share it): a failure."""
    from ..facts.machine_identity import NodeIdentity, duplicates

    ids = [NodeIdentity(n, hostnames.get(n, n), 0, None, machine_ids.get(n)) for n in nodes]
    return [_f(CLUSTER_ROW, "identity", FAIL, "same machine", line.replace(", port 0", ""),
               "correct the HostName of one alias (`ssh -G ALIAS` shows what it resolves to), or give a "
               "cloned machine its own machine-id (systemd-machine-id-setup)") for line in duplicates(ids)]


def rule_containers(node: str, facts: F.NodeFacts, needs: Needs) -> Finding:
    if facts.containers is None:
        return _unknown(node, "containers", facts, "docker-ps")
    if not facts.containers:
        return _f(node, "containers", OK, "none")
    running = [c for c in facts.containers if c.state == "running"]
    names = ", ".join(f"{c.names} ({c.state})" for c in facts.containers)
    if running:
        return _f(
            node,
            "containers",
            FAIL,
            f"{len(running)} running",
            f"{node}: sparkctl containers of cluster {needs.cluster!r} are running: {names}",
            "`sparkctl down` stops them before a new `up`",
        )
    return _f(
        node,
        "containers",
        WARN,
        f"{len(facts.containers)} stale",
        f"{node}: stale sparkctl containers: {names}",
        "`sparkctl down` removes them",
    )


def rule_plan(node: str, facts: F.NodeFacts, plan: Plan | None, why_no_plan: str = "") -> Finding:
    if plan is None:
        return _f(node, "plan", WARN, "not planned", f"{node}: memory plan not made: {why_no_plan}")
    short = f"{gb(plan.per_rank_total)}/{gb(plan.available)}"
    if plan.headroom < 0:
        return _f(
            node,
            "plan",
            FAIL,
            "does not fit",
            f"{node}: {plan.problems()[0]}",
            "lower MAX_MODEL_LEN or MAX_FULL_SEQS, or use a smaller pack",
        )
    return _f(node, "plan", OK, short, f"{node}: {short} per rank ({gb(plan.headroom)} headroom), planned "
              f"against this node's MemTotal {gb(plan.node_memory_bytes)}")


# -------------------------------------------------------------------------------- cross-node rules


def rule_model(
    listings: Mapping[str, F.ModelListing | None], head: str, model: str, problems: Mapping[str, str]
) -> dict[str, Finding]:
    """The model folder exists on every node with the same shard set and sizes (reference: what most
    nodes hold; the head's on a tie). A node that differs usually mounts a different folder (the NFS
    server not bind-mounting its own export at the shared path)."""
    out: dict[str, Finding] = {}
    present = {n: lst for n, lst in listings.items() if lst is not None and lst.exists}
    for n, lst in listings.items():
        if lst is None:
            out[n] = _f(
                n,
                "model",
                FAIL,
                "unreadable",
                f"{n}: could not list MODEL={model}: {problems.get(n) or 'no answer'}",
                f"check that {model} is readable on {n} (`ls -l {model}` there)",
            )
        elif not lst.exists:
            out[n] = _f(
                n,
                "model",
                FAIL,
                "missing",
                f"{n}: MODEL={model} does not exist there",
                f"mount the shared checkpoint at {model} on {n} (the NFS server itself must bind-mount its "
                "export at that path)",
            )
        elif not lst.shards:
            out[n] = _f(
                n,
                "model",
                FAIL,
                "no shards",
                f"{n}: {model} holds no *.safetensors",
                f"point MODEL at the checkpoint folder; check the mount on {n}",
            )
    keyed = {n: tuple(sorted(lst.shards.items())) for n, lst in present.items() if lst.shards}
    if not keyed:
        return out
    counts = Counter(keyed.values())
    top = max(counts.values())
    best = [k for k, c in counts.items() if c == top]
    ref = keyed[head] if head in keyed and keyed[head] in best else best[0]
    ref_map = dict(ref)
    for n, key in keyed.items():
        mine = dict(key)
        if key == ref:
            total = sum(mine.values())
            out[n] = _f(n, "model", OK, f"{len(mine)} shards", f"{n}: {len(mine)} shards, {gb(total)}")
            continue
        missing = sorted(set(ref_map) - set(mine))
        extra = sorted(set(mine) - set(ref_map))
        sized = sorted(k for k in set(mine) & set(ref_map) if mine[k] != ref_map[k])
        parts = []
        for label, names in (("missing", missing), ("extra", extra), ("different size", sized)):
            if names:
                parts.append(f"{label}: {', '.join(names[:4])}{' …' if len(names) > 4 else ''}")
        out[n] = _f(
            n,
            "model",
            FAIL,
            "differs",
            f"{n}: {model} differs from the other nodes' ({'; '.join(parts)})",
            f"re-sync {n}'s copy, or fix its mount so it sees the shared folder",
        )
    for n, lst in present.items():
        if lst.unlisted and n in out:
            odd = (f"{lst.unlisted} file(s) in {model} whose name holds a newline (not listed, so not "
                   "compared: vLLM may still load one as a shard)")
            was = out[n]
            out[n] = replace(was, status=WARN if was.status == OK else was.status, reason=f"{was.text}; {odd}",
                             fix=was.fix or f"rename or remove them on {n} (`ls -bR {model}` shows a newline as \\n)")
    return out


def rule_image(
    images: Mapping[str, list[D.Image] | None], head: str, ref: str, problems: Mapping[str, str]
) -> dict[str, Finding]:
    """The image every rank runs (the chain's top layer, IMAGE) is the same on every node: the same
    sparkctl content hash when sparkctl built it (a build on each rank gives each copy its own ID, from
    creation times, for the same inputs), else the same image ID. A missing image is a warning
    (`sparkctl build` makes it); a different one is a failure."""
    out: dict[str, Finding] = {}
    ids: dict[str, D.Image] = {}
    for n, imgs in images.items():
        img = D.find_image(imgs or [], ref) if imgs is not None else None
        if imgs is None:
            out[n] = _f(
                n,
                "image",
                FAIL,
                "unreadable",
                f"{n}: could not inspect images: {problems.get(n) or 'no answer'}",
                f"check the Docker engine on {n} (`docker image inspect {ref}` there)",
            )
        elif img is None:
            out[n] = _f(n, "image", WARN, "missing", f"{n}: image {ref} is not there", "run `sparkctl build`")
        else:
            ids[n] = img
    if not ids:
        return out
    def identity(img: D.Image) -> str:
        return img.labels.get("sparkctl.content-hash") or img.id

    counts = Counter(identity(i) for i in ids.values())
    top = max(counts.values())
    best = [i for i, c in counts.items() if c == top]
    ref_id = identity(ids[head]) if head in ids and identity(ids[head]) in best else best[0]
    for n, img in ids.items():
        short_id = img.id.removeprefix("sha256:")[:12]
        if identity(img) == ref_id:
            how = "" if img.id == ref_id else f" (content {ref_id.removeprefix('sha256:')[:12]})"
            out[n] = _f(n, "image", OK, short_id, f"{n}: {ref} = {short_id}{how}")
        else:
            same_layers = img.layers == next(i.layers for i in ids.values() if identity(i) == ref_id)
            detail = "same layers, different image config" if same_layers else "different layers"
            out[n] = _f(
                n,
                "image",
                FAIL,
                "differs",
                f"{n}: {ref} is {short_id}, the other ranks have "
                f"{ref_id.removeprefix('sha256:')[:12]} ({detail})",
                "run `sparkctl build` so every rank runs the same image",
            )
    return out


def rule_versions(images: Mapping[str, list[D.Image] | None], head: str, ref: str,
                  expect: Mapping[str, str]) -> dict[str, Finding]:
    """What IMAGE reports (the `sparkctl.versions` label `build` records after its version probe) is the
    same on every rank and what the recipe expects (e.g. exllamav3 1.4.5 after v145). An image without
    the label (not built by this sparkctl) is not judged here."""
    from ..image.chain import read_versions, version_disagreements, version_problems

    found = {n: v for n, imgs in images.items() if imgs is not None
             if (img := D.find_image(imgs, ref)) is not None and (v := read_versions(img)) is not None}
    out: dict[str, Finding] = {}
    differ = version_disagreements(found, head)
    for n, versions in found.items():
        problems = version_problems(expect, versions)
        if problems:
            out[n] = _f(n, "versions", FAIL, "expect", f"{n}: {ref}: {'; '.join(problems)}",
                        "fix the checkpoint's serving/Dockerfile.* and run `sparkctl build`")
        elif n in differ:
            out[n] = _f(n, "versions", FAIL, "differs", f"{n}: {ref} reports {differ[n]}",
                        "run `sparkctl build` so every rank builds the same chain")
        else:
            short = " ".join(f"{k}={v}" for k, v in sorted(versions.items()) if v != "absent")
            out[n] = _f(n, "versions", OK, short[:40] or "-", f"{n}: {ref}: {short or 'nothing importable'}")
    return out


def rule_base_image(images: Mapping[str, list[D.Image] | None], head: str, ref: str) -> dict[str, Finding]:
    """Every rank holds the head's base image (by image ID: RepoDigests do not survive save | load).
    A rank with another one is the stale-base case: one `sparkctl build` gives it the head's."""
    from ..image.base_image import identify, stale

    head_img = D.find_image(images.get(head) or [], ref)
    if head_img is None:
        return {n: _f(n, "base", WARN, "missing", f"{n}: base image {ref} is not on the head {head} yet",
                      "run `sparkctl build` (it pulls the base on the head first)") for n in images if images[n] is not None}
    p = identify(ref, head_img)
    out: dict[str, Finding] = {}
    for n, imgs in images.items():
        if imgs is None:
            continue  # rule_image already says the images could not be read
        why = stale(p, D.find_image(imgs, ref))
        short = p.id.removeprefix("sha256:")[:12]
        if why is None:
            out[n] = _f(n, "base", OK, short, f"{n}: {ref} = {p.describe()}")
        else:
            missing = "not on the node" in why
            out[n] = _f(n, "base", WARN if missing else FAIL, "missing" if missing else "stale", f"{n}: {why}",
                        f"run `sparkctl build`: it gives {n} the head's base ({p.describe()}), once")
    return out



def _names_device(value: str, device: str) -> bool:
    """Whether an NCCL interface/HCA list selects `device`, as NCCL reads it: comma-separated prefixes,
    `=` for exact names, `^` to exclude, `:port` suffixes on HCAs (NCCL_IB_HCA / NCCL_SOCKET_IFNAME)."""
    exclude = value.startswith("^")
    body = value.removeprefix("^")
    exact = body.startswith("=")
    items = [i.split(":", 1)[0].strip() for i in body.removeprefix("=").split(",") if i.strip()]
    hit = any(device == i if exact else device.startswith(i) for i in items)
    return not hit if exclude else hit


def rule_pin_env(node: str, pin: RankPins, env: Sequence[tuple[str, str]], recipe_path: str) -> Finding | None:
    """A pin key in the recipe's [container.env] is the same for every rank and wins over the pin
    `check` found on the node: it must still name this node's own NIC, GID index and address."""
    if not env:
        return None
    clashes = []
    for key, value in env:
        mine = getattr(pin, PIN_ENV[key])
        if mine is None:
            continue
        ok = _names_device(value, str(mine)) if PIN_ENV[key] in ("netdev", "rdma_dev") else value == str(mine)
        if not ok:
            clashes.append(f"{key}={value} (this node's is {mine})")
    if not clashes:
        return _f(node, "pin-env", OK, "agrees", f"{node}: the recipe's pins ({', '.join(k for k, _ in env)}) "
                  "name this node's own fabric")
    keys = ", ".join(c.split("=", 1)[0] for c in clashes)
    return _f(node, "pin-env", FAIL, "overridden",
              f"{node}: the recipe's [container.env] sets {'; '.join(clashes)} for every rank, and it wins over "
              "the pin found here: NCCL on this rank would use another NIC or GID, or fall back",
              f"remove {keys} from [container.env] in {recipe_path}: sparkctl pins every rank to its own NIC")


def rule_prebuilt_pin(ref: str, source: str) -> list[Finding]:
    """A published image named by a tag can change under the same name between two pulls: ranks pulled
    at different times would run different images. Pinned by digest, every pull is the same image."""
    if "@sha256:" in ref:
        return [_f(CLUSTER_ROW, "image-pin", OK, "digest", f"IMAGE is pinned by digest ({ref})")]
    return [_f(CLUSTER_ROW, "image-pin", WARN, "tag",
               f"IMAGE={ref} is a tag: the published image ({source}) can move under it",
               "pin it by digest: IMAGE=<repo>@sha256:<digest> (`sparkctl build --json` prints the digest the "
               "head resolved)")]


def rule_checkpoint(report: Any, error: str | None) -> list[Finding]:
    """Header-level verification of the checkpoint on the head (sparkctl.checkpoint.verify over ckpt_scan)."""
    if error:
        return [
            _f(
                CLUSTER_ROW,
                "checkpoint",
                WARN,
                "not verified",
                f"checkpoint headers not verified: {error}",
                "run `sparkctl verify-model` for the details",
            )
        ]
    if report is None:
        return []
    details = "run `sparkctl verify-model` for the details"
    out = [replace(f, fix=f.fix or details) for f in report.findings if f.status == FAIL]
    out += [f for f in report.findings if f.status == WARN]
    if not out:
        s = report.summary
        out.append(
            _f(
                CLUSTER_ROW,
                "checkpoint",
                OK,
                f"{s.shards} shards ok",
                f"checkpoint headers verified: {s.shards} shards, {s.tensors} tensors, {s.quantized_line()}",
            )
        )
    return out


def rule_gpu_memory_utilization(plan: Plan | None) -> Finding | None:
    if plan is None:
        return None
    if plan.gpu_memory_utilization > plan.gpu_memory_utilization_cap:
        return _f(
            CLUSTER_ROW,
            "plan",
            FAIL,
            "gpu util > cap",
            next(p for p in plan.problems() if "GPU_MEMORY" in p),
            f"set GPU_MEMORY_UTILIZATION ≤ {plan.gpu_memory_utilization_cap:g}",
        )
    return _f(
        CLUSTER_ROW,
        "plan",
        OK,
        f"util {plan.gpu_memory_utilization:g}",
        f"GPU_MEMORY_UTILIZATION={plan.gpu_memory_utilization:g} ≤ cap {plan.gpu_memory_utilization_cap:g}; "
        f"KV cache {plan.kv_cache_memory_bytes} B per rank",
    )


def rule_open_api(warning: str | None) -> Finding | None:
    """The service would answer anyone who reaches the head's port, with no API key: a warning."""
    if warning is None:
        return None
    return _f(CLUSTER_ROW, "api", WARN, "open, no key", warning,
              "set VLLM_API_KEY in the env file, or VLLM_EXTRA_ARGS='--host 127.0.0.1'")


# ------------------------------------------------------------------------------ the reach test's lines


REACH_BY_HAND = "sh -c '. ./reach.sh; reach_test MASTER_PORT PEER_IP...' (sparkctl/probes/reach.sh)"


def parse_reach(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        status, _, rest = line.partition(" ")
        ip, _, why = rest.partition(" ")
        if status in ("ok", "fail") and ip:
            out[ip] = "ok" if status == "ok" else (why.strip() or "failed")[:200]
    return out


def evaluate(
    nodes: Sequence[str],
    needs: Needs,
    gathered: Mapping[str, tuple[F.NodeFacts | NodeError, Any]],
    connect_errors: Mapping[str, NodeError],
    plan_for_node: Callable[[F.NodeFacts], tuple[Plan | None, str]],
    verify_scan: Callable[[Mapping[str, Any]], Any] | None,
    heads: Sequence[str] = (),
) -> tuple[list[Finding], dict[int, RankPins]]:
    """Every round-1 rule over every node (pure, given the gathered facts). heads: every replica's head
    (each serves PORT), replica 0's first: it reads the checkpoint; default: the first node, one replica.
    Pins are keyed by position in NODES, the numbering of the RANK<n>_* knobs."""
    heads = tuple(heads) or (nodes[0],)
    head = heads[0]
    findings: list[Finding] = []
    pins: dict[int, RankPins] = {}
    good: dict[str, F.NodeFacts] = {}
    engine_down: set[str] = set()
    for rank, n in enumerate(nodes):
        error = connect_errors.get(n)
        got = gathered.get(n)
        if error is None and got is not None and isinstance(got[0], NodeError):
            error = got[0]
        findings.append(rule_ssh(n, error))
        if error is not None or got is None or not isinstance(got[0], F.NodeFacts):
            findings += [_f(n, c, SKIP, "-", f"{n}: not checked (no SSH)") for c in CHECKS[1:]]
            continue
        facts = good[n] = got[0]
        fabric, pin = discover_fabric(n, rank, facts, needs)
        fabric = with_fabric_record(fabric, rule_fabric_record(n, facts))
        if pin is not None:
            pins[rank] = pin
            if (overridden := rule_pin_env(n, pin, needs.pin_env, needs.recipe_path)) is not None:
                findings.append(overridden)
        plan, why = plan_for_node(facts)
        docker = rule_docker(n, facts)
        if docker.status == FAIL:  # one failure with one fix, not three: image and containers wait
            engine_down.add(n)
        findings += [
            docker,
            rule_gpu(n, facts, needs, good.get(head)),
            rule_memory(n, facts, plan, needs),
            rule_limits(n, facts, needs),
            fabric,
            rule_ports(n, facts, needs, is_head=n in heads),
            rule_disk(n, facts),
            _f(n, "containers", SKIP, "-", f"{n}: not checked (Docker engine)")
            if n in engine_down
            else rule_containers(n, facts, needs),
            rule_plan(n, facts, plan, why),
        ]
    findings += rule_model(
        {n: f.model for n, f in good.items()},
        head,
        needs.model,
        {n: f.problems.get("model", "") for n, f in good.items()},
    ).values()
    findings += rule_image(
        {n: f.images for n, f in good.items() if n not in engine_down},
        head,
        needs.image,
        {n: f.problems.get("docker-images", "") for n, f in good.items()},
    ).values()
    findings += [_f(n, "image", SKIP, "-", f"{n}: not checked (Docker engine)") for n in engine_down]
    findings += rule_versions(
        {n: f.images for n, f in good.items() if n not in engine_down}, head, needs.image, dict(needs.expect)
    ).values()
    findings += rule_parity([n for n in nodes if n in good], good,
                            {n: f.images for n, f in good.items() if n not in engine_down}, head, needs.image)
    if needs.prebuilt:
        findings += rule_prebuilt_pin(needs.image, needs.prebuilt)
    if needs.base_image:
        findings += rule_base_image(
            {n: f.images for n, f in good.items() if n not in engine_down}, head, needs.base_image
        ).values()
    if verify_scan is not None and head in gathered and head in good:
        scan = gathered[head][1]
        if isinstance(scan, dict):
            try:
                findings += rule_checkpoint(verify_scan(scan), None)
            except Exception as exc:  # the verifier is another module: its bug must not hide the table
                findings += rule_checkpoint(None, f"{type(exc).__name__}: {exc}")
        elif isinstance(scan, str):
            findings += rule_checkpoint(None, scan)
    return findings, pins


def node_compute_cap(facts: F.NodeFacts) -> str | None:
    """The node's GPU compute capability as nvidia-smi reports it (12.1 on GB10), None when unknown."""
    return facts.gpus[0].compute_cap if facts.gpus else None
