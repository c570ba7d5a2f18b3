"""`check`'s parity row: what must agree across the ranks, and the known-bad combinations.

Pure: node facts (and the serving image each node holds) in, one `parity` finding per node out. A fact
that differs names the odd node and what the others have: a warning, a failure where the field shows it
breaks a run (the fabric ports' MTU: RoCE drops what does not fit). The known-bad combinations fail on
their own, each with its source (docs/sources.md, "Node parity"):

- kernel 7.0.0-1019 with CMA=0 (CmaTotal 0 in /proc/meminfo, or `cma=0` on its command line) on a node
  with RDMA devices: `ibv_reg_mr` fails with ENOMEM (MiaAI DSv4.1-Flash-DGX-Sparks #14);
- an image whose CUDA needs a newer driver than the host's (CUDA's "toolkit and corresponding driver
  versions" table, CUDA_MIN_DRIVER; eugr/spark-vllm-docker #266: an image built for 590 on 580 hosts);
- an image carrying /etc/nccl.conf, which NCCL reads over the recipe's NCCL_* settings.

The image's NCCL (and vLLM, torch) versions are compared by the `versions` row from the label `build`
records; parity reads the same label for the CUDA version and /etc/nccl.conf.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from ..facts import docker_parse as D
from ..facts import node_facts as F
from .findings import FAIL, OK, SKIP, WARN, Finding
from .findings import finding as _f

CHECK: Final = "parity"

CUDA_MIN_DRIVER: Final[tuple[tuple[str, str], ...]] = (
    ("12.0", "525.60.13"),
    ("12.1", "530.30.02"),
    ("12.2", "535.54.03"),
    ("12.3", "545.23.06"),
    ("12.4", "550.54.14"),
    ("12.5", "555.42.02"),
    ("12.6", "560.28.03"),
    ("12.8", "570.26"),
    ("12.9", "575.51.03"),
    ("13.0", "580.65.06"),
    ("13.1", "590.44.01"),
)
"""CUDA toolkit (major.minor, its GA release) -> the minimum Linux driver it needs: NVIDIA's CUDA Toolkit
release notes, table "CUDA Toolkit and Corresponding Driver Versions" (docs/sources.md). A CUDA not in
the table is not judged."""

BAD_KERNEL_PREFIX: Final = "7.0.0-1019"
"""The kernel release whose RDMA memory registration fails with CMA=0 (docs/sources.md)."""


def version_tuple(text: str) -> tuple[int, ...]:
    """'580.65.06' -> (580, 65, 6); the leading numeric part only ('13.0.1-1' -> (13, 0, 1))."""
    m = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def min_driver_for_cuda(cuda: str) -> str | None:
    """The driver CUDA `cuda` (e.g. '13.0', '12.8.1') needs, or None when the table does not list it."""
    want = version_tuple(cuda)[:2]
    return next((drv for ver, drv in CUDA_MIN_DRIVER if version_tuple(ver) == want), None)


def fabric_mtus(facts: F.NodeFacts) -> str | None:
    """The MTU of the RDMA devices' netdevs that are up with an address (the fabric ports that carry RoCE v2
    traffic): '9000' when they agree, else each port's ('enp1s0f0np0=9000 enp1s0f1np1=1500'). A port without a
    cable or an address keeps its default MTU, and a node cabled on both ports beside nodes cabled on one is
    no difference that drops frames."""
    if not facts.hcas or facts.netdevs is None:
        return None
    ports = sorted({d for h in facts.hcas for d in h.netdevs})
    live = {d.name: d.mtu for d in facts.netdevs if d.is_up and d.ipv4}
    mtus = [(p, live[p]) for p in ports if live.get(p) is not None]
    if len({m for _, m in mtus}) == 1:
        return str(mtus[0][1])
    return " ".join(f"{p}={m}" for p, m in mtus) or None


def _driver(facts: F.NodeFacts) -> str | None:
    return next((g.driver_version for g in facts.gpus or [] if g.driver_version), None)


def _cuda_driver(facts: F.NodeFacts) -> str | None:
    return facts.gpu_banner.cuda_version if facts.gpu_banner else None


def _firmware(facts: F.NodeFacts) -> str | None:
    return " ".join(sorted(set(facts.firmware.values()))) or None if facts.firmware else None


def _docker(facts: F.NodeFacts) -> str | None:
    return facts.docker.server_version if facts.docker else None


def _kernel(facts: F.NodeFacts) -> str | None:
    return facts.kernel.release if facts.kernel else None


# (label, how it is read, the status a difference gets): the facts that must agree across the ranks.
FIELDS: Final[tuple[tuple[str, Callable[[F.NodeFacts], str | None], str], ...]] = (
    ("kernel", _kernel, WARN),
    ("driver", _driver, WARN),
    ("CUDA driver", _cuda_driver, WARN),  # the banner is asked on the head only: compared where known
    ("CX7 firmware", _firmware, WARN),
    ("fabric MTU", fabric_mtus, FAIL),  # RoCE frames that do not fit the peer's MTU are dropped: NCCL hangs
    ("Docker", _docker, WARN),
)


def differences(values: Mapping[str, str | None], head: str) -> dict[str, str]:
    """node -> 'VALUE, the others have OTHER (a, b)' for each node whose value is not the reference: the
    commonest value, the head's where it is among the commonest. Unknown values are not compared."""
    known = {n: v for n, v in values.items() if v is not None}
    if len(set(known.values())) < 2:
        return {}
    counts = Counter(known.values())
    top = max(counts.values())
    best = [v for v, c in counts.items() if c == top]
    ref = known[head] if head in known and known[head] in best else best[0]
    others = [n for n, v in known.items() if v == ref]
    return {n: f"{v}, the others have {ref} ({', '.join(others)})" for n, v in known.items() if v != ref}


def known_bad(node: str, facts: F.NodeFacts, image: D.Image | None, versions: Mapping[str, str] | None,
              ref: str) -> list[tuple[str, str, str]]:
    """The known-bad combinations on one node: (short, reason, fix) each."""
    out: list[tuple[str, str, str]] = []
    kernel = facts.kernel
    if kernel is not None and kernel.release.startswith(BAD_KERNEL_PREFIX) and facts.hcas:
        cma = facts.meminfo.cma_total_bytes if facts.meminfo else None
        param = kernel.cma_param
        if cma == 0 or (param is not None and version_tuple(param) == (0,)):
            why = "CmaTotal is 0 kB" if cma == 0 else f"its command line sets cma={param}"
            out.append(("CMA=0", f"{node}: kernel {kernel.release} with CMA=0 ({why}) and RDMA devices: "
                        "ibv_reg_mr fails with ENOMEM, NCCL cannot register its buffers",
                        f"on {node}: boot another kernel, or give it a CMA pool (e.g. cma=512M on the kernel "
                        "command line) and reboot"))
    cuda = (versions or {}).get("cuda")
    cuda = cuda if cuda and cuda != "absent" else (image.cuda_version if image else None)
    driver = _driver(facts)
    need = min_driver_for_cuda(cuda) if cuda else None
    if need and driver and version_tuple(driver) < version_tuple(need):
        out.append(("driver<CUDA", f"{node}: {ref} is built for CUDA {cuda}, which needs driver ≥ {need}; "
                    f"{node} has {driver}",
                    f"upgrade the NVIDIA driver on {node} to ≥ {need}, or build the image on a CUDA "
                    f"that driver {driver} supports"))
    if (versions or {}).get("nccl.conf") == "present":
        out.append(("nccl.conf", f"{node}: {ref} carries /etc/nccl.conf, which NCCL reads over the recipe's "
                    "NCCL_* settings", "remove /etc/nccl.conf in the image's Dockerfile "
                    "(RUN rm -f /etc/nccl.conf) and run `sparkctl build`"))
    return out


def rule_parity(nodes: Sequence[str], facts: Mapping[str, F.NodeFacts],
                images: Mapping[str, list[D.Image] | None], head: str, ref: str) -> list[Finding]:
    """One `parity` finding per node with facts: its differences from the others and its known-bad
    combinations (each said), the worst status first in the cell."""
    from ..image.chain import read_versions

    diffs: dict[str, list[tuple[str, str, str]]] = {n: [] for n in nodes if n in facts}
    for label, read, status in FIELDS:
        for n, text in differences({n: read(f) for n, f in facts.items()}, head).items():
            diffs[n].append((status, label, f"{n}: {label} {text}"))
    out: list[Finding] = []
    for n in diffs:
        imgs = images.get(n)
        image = D.find_image(imgs, ref) if imgs else None
        versions = read_versions(image) if image else None
        bad = known_bad(n, facts[n], image, versions, ref)
        items = [(FAIL, short, reason) for short, reason, _ in bad] + diffs[n]
        if not items:
            seen = [f"{label} {v}" for label, read, _ in FIELDS if (v := read(facts[n])) is not None]
            out.append(_f(n, CHECK, OK if seen else SKIP, "same" if seen else "-",
                          f"{n}: {'; '.join(seen) or 'nothing to compare'}"))
            continue
        worst = FAIL if any(s == FAIL for s, _, _ in items) else WARN
        fixes = [fix for _, _, fix in bad] + [
            f"bring {n}'s {label} in line with the other ranks" for _, label, _ in diffs[n]]
        out.append(_f(n, CHECK, worst, ", ".join(short for _, short, _ in items)[:40],
                      "; ".join(reason for _, _, reason in items), "; ".join(fixes)))
    return out
