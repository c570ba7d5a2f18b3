"""The fabric test (`check --fabric` / `up --fabric-test`): a real all-reduce across the ranks before the
model loads.

On every rank a short-lived container of the image that will serve (the recipe's `[fabric] image`
where the lab names its own) runs sparkctl's fabric program (probes/fabric_allreduce.py, on stdin)
with the environment `up` would give that rank (builders.rank_env: NIC pins, GID index, recipe env;
secrets left out) plus NCCL_DEBUG=INFO. Every container is labelled with this cluster's labels and
`sparkctl.purpose=fabric-test`, runs with --rm, and is removed by label afterwards on every node --
also after a timeout, a lost node or Ctrl-C. The whole run is bounded: the program stops itself at the
recipe's timeout, and each node's `docker run` has that timeout plus a start allowance.

The ranks meet on the head at `fabric_port`: MASTER_PORT + 1, or the next port up that is neither
MASTER_PORT, PORT nor one the head was seen listening on (`check` reads its listeners first). Never the
service's own: `check --fabric` may run beside a serving cluster, whose rendezvous holds MASTER_PORT on
the head, and a test holding MASTER_PORT would make an `up` starting then fail. (`check`'s reach test
already tries MASTER_PORT itself between the ranks.)

Findings (check `collective`): a rank that failed or never joined (named), NCCL on sockets where RDMA
was expected, NCCL versions that differ, busbw below the recipe's floor.
"""

from __future__ import annotations

import functools
import shlex
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..cluster import Cluster, Node, NodeError, RunResult
from ..rules import nccl
from ..rules.findings import CLUSTER_ROW, FAIL, OK, SKIP, WARN, Finding
from ..spec.builders import LABEL_CLUSTER, LABEL_RANK, LABEL_RECIPE, container_options, master_addr, rank_env
from ..spec.recipes import FabricTest
from ..spec.resources import probe_script
from ..spec.settings import RankPins, Settings
from ..threads import spawn, wait_all, wait_bounded

CHECK = "collective"
LABEL_PURPOSE = "sparkctl.purpose"
PURPOSE = "fabric-test"
START_ALLOWANCE_S = 30.0  # docker run + interpreter + torch import, beyond the program's own bound
PROGRAM = "fabric_allreduce.py"
PORT_WORDS = "the test's port on the head (MASTER_PORT + 1 or the next free one; the run's first line names it)"

# The lab's fabric-test image (`sparkctl lab torch` loads it; lab.state.TORCH_IMAGE, which a unit test keeps
# equal): named here so that production code does not import the lab.
LAB_TORCH_IMAGE = "sparkctl-lab/torch:latest"

# Remove this cluster's fabric-test containers (both labels must match: never the service's own).
_SWEEP = r'''ids=$(docker ps -aq --no-trunc --filter "label=$1" --filter "label=$2") || exit $?
[ -z "$ids" ] || docker rm -f $ids >/dev/null || exit $?
echo "$ids" | grep -c . || true'''


def sweep_by_hand(cluster: str) -> str:
    """What a person pastes on a node to do the sweep's work: both labels, each one quoted word."""
    ps = shlex.join(["docker", "ps", "-aq", "--filter", f"label={LABEL_CLUSTER}={cluster}",
                     "--filter", f"label={LABEL_PURPOSE}={PURPOSE}"])
    return f"docker rm -f $({ps})"


def fabric_container_name(cluster: str, rank: int) -> str:
    return f"sparkctl-{cluster}-fabric-rank{rank}"


def fabric_image(settings: Settings) -> str:
    return settings.recipe.fabric.image or settings.image


def fabric_env(settings: Settings, rank: int, pins: RankPins) -> dict[str, str]:
    """The rank's container environment as `up` renders it, without secrets (they never travel on a
    command line, and the test needs none), plus NCCL's own account of what it chose."""
    secret = set(settings.secrets())
    env = {k: v for k, v in rank_env(settings, rank, pins).items() if k not in secret}
    env["NCCL_DEBUG"] = "INFO"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _without_mounts(options: list[str]) -> list[str]:
    """The service's container options minus its bind mounts: the test needs no model, and a missing
    model folder must not read as a fabric failure."""
    out: list[str] = []
    skip = False
    for word in options:
        if skip:
            skip = False
            continue
        if word == "--mount":
            skip = True
            continue
        out.append(word)
    return out


def fabric_port(settings: Settings, busy: Iterable[int] = ()) -> int:
    """The port the ranks meet on (see the module's docstring); `busy`: the ports the head listens on."""
    master = settings.getint("MASTER_PORT")
    taken = {master, settings.getint("PORT"), *busy}
    return next(p for p in (*range(master + 1, 65536), *range(1024, master)) if p not in taken)


def fabric_run_argv(settings: Settings, rank: int, pins: list[RankPins], *, timeout_s: float | None = None,
                    port: int | None = None) -> list[str]:
    """`docker run` of one rank's fabric test: the service's options, the rank's env, the program on stdin;
    the ranks meet at the head's `port` (default: `fabric_port` with no port known busy)."""
    fab = settings.recipe.fabric
    cluster = settings.cluster_name
    argv = [
        "docker", "run", "--rm", "--interactive", "--pull", "never",
        "--name", fabric_container_name(cluster, rank),
        "--label", f"{LABEL_CLUSTER}={cluster}",
        "--label", f"{LABEL_RANK}={rank}",
        "--label", f"{LABEL_RECIPE}={settings.recipe.name}",
        "--label", f"{LABEL_PURPOSE}={PURPOSE}",
        *_without_mounts(container_options(settings)),
    ]  # fmt: skip
    for key, value in sorted(fabric_env(settings, rank, pins[rank]).items()):
        argv += ["--env", f"{key}={value}"]
    argv += [
        "--entrypoint", "python3", fabric_image(settings), "-",
        "--rank", str(rank), "--world", str(len(settings.nodes)),
        "--master-addr", master_addr(settings, pins),
        "--master-port", str(port if port is not None else fabric_port(settings)),
        "--backend", fab.backend, "--sizes", ",".join(str(s) for s in fab.sizes),
        "--warmup", str(fab.warmup), "--iters", str(fab.iters),
        "--deadline", f"{timeout_s if timeout_s is not None else fab.timeout_s:g}",
    ]  # fmt: skip
    return argv


@dataclass
class RankOutcome:
    rank: int
    node: str
    events: list[dict[str, Any]] = field(default_factory=list)
    nccl: nccl.RankLog | None = None
    error: str | None = None  # the node or docker failed (lost node, no image, ...)
    exit_code: int | None = None
    output_tail: list[str] = field(default_factory=list)
    stopped_by: int | None = None  # sparkctl stopped this rank because that rank failed first

    lost: bool = False  # the node or its SSH connection failed (not the container)
    missing_image: bool = False  # docker had no such image on the node (`--pull never`): nothing ran

    @property
    def events_say_why(self) -> bool:
        return any(e.get("event") in ("done", "error", "timeout") for e in self.events) or self.lost

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)

    @property
    def results(self) -> list[dict[str, Any]]:
        return [e for e in self.events if nccl.is_result(e)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "node": self.node, "exit_code": self.exit_code, "error": self.error,
            "joined": self.event("joined") is not None, "done": self.event("done") is not None,
            "busbw_gbps": {str(e.get("bytes")): e.get("busbw_gbps") for e in self.results},
            "events": self.events, "nccl": self.nccl.to_dict() if self.nccl else None,
            "output_tail": self.output_tail,
        }  # fmt: skip


@dataclass
class FabricReport:
    backend: str
    image: str
    outcomes: list[RankOutcome]
    findings: list[Finding]
    seconds: float
    collective_s: float  # the slowest rank's time from joining to done (the program's own figure)
    cleanup: dict[str, str]  # node -> problem, where a sweep failed
    swept: dict[str, int]  # node -> containers the sweep removed (0 when --rm had already done it)

    @property
    def ok(self) -> bool:
        return not any(f.status == FAIL for f in self.findings)

    def busbw_by_size(self) -> dict[str, float]:
        """The slowest rank's busbw per size (what the collective as a whole achieved)."""
        out: dict[str, float] = {}
        for o in self.outcomes:
            for e in o.results:
                key = str(e.get("bytes"))
                val = float(e.get("busbw_gbps") or 0)
                out[key] = min(out.get(key, val), val)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "backend": self.backend, "image": self.image, "seconds": round(self.seconds, 3),
            "collective_s": round(self.collective_s, 3), "busbw_gbps": self.busbw_by_size(),
            "ranks": [o.to_dict() for o in self.outcomes], "findings": [f.to_dict() for f in self.findings],
            "cleanup_problems": self.cleanup, "swept": self.swept,
        }  # fmt: skip


def failed_early(res: RunResult) -> bool:
    """The rank's container ended without finishing: an error or a timeout of its own, or no `done`."""
    if res.ok:
        return False
    return FABRIC_DONE not in res.stdout


FABRIC_DONE = nccl.FABRIC_MARK + '{"event":"done"'


def outcome_from_run(rank: int, node: str, res: RunResult | NodeError) -> RankOutcome:
    if isinstance(res, NodeError):
        return RankOutcome(rank, node, error=res.reason, lost=True)
    text = res.stdout + ("\n" + res.stderr if res.stderr else "")
    log = nccl.parse(text, source=f"rank {rank}")
    mine = log.ranks[0] if log.ranks else None
    tail = [ln for ln in text.splitlines() if ln.strip() and nccl.FABRIC_MARK not in ln][-5:]
    out = RankOutcome(rank, node, events=log.events, nccl=mine, exit_code=res.exit_code, output_tail=tail)
    if not log.events and res.exit_code != 0:
        first = next((ln for ln in res.stderr.splitlines() if ln.strip()), f"exit status {res.exit_code}")
        out.error = f"the fabric test container did not run: {first[:300]}"
        out.missing_image = _no_such_image(res.stderr)
    return out


def _no_such_image(stderr: str) -> bool:
    """docker run --pull never of an image the engine lacks: "docker: Error response from daemon: No such
    image: REF" (the daemon's words, whatever the client's version)."""
    return "no such image" in stderr.lower()


def missing_image_fix(fab: FabricTest, node: str) -> str:
    """What puts the fabric test's image on a node that lacks it: the lab loads its torch image, production
    builds (or pulls, or ships) the serving image, and a recipe's own [fabric] image is the user's to load."""
    again = "then run `sparkctl check --fabric` again"
    if fab.image == LAB_TORCH_IMAGE:
        return f"run `sparkctl lab torch` (it loads {LAB_TORCH_IMAGE} into every lab host), {again}"
    if not fab.image:
        return (f"run `sparkctl build` (the test runs in the serving image, IMAGE: build makes it on every rank, "
                f"or pulls or ships a prebuilt one), {again}")
    return f"load the recipe's [fabric] image {fab.image} on {node} (`docker pull` or `docker load`), {again}"


def evaluate(outcomes: list[RankOutcome], fab: FabricTest, *, timeout_s: float) -> list[Finding]:
    """Per rank one `collective` finding (table cell), then the cluster-wide ones."""
    findings: list[Finding] = []
    not_joined: list[str] = []
    for o in outcomes:
        who = f"rank {o.rank} ({o.node})"
        err = o.event("error")
        timeout = o.event("timeout")
        if o.error and o.missing_image:
            findings.append(Finding(o.node, CHECK, FAIL, "no image", f"{who}: {o.error}",
                                    missing_image_fix(fab, o.node)))
            not_joined.append(str(o.rank))
            continue
        if o.error:
            findings.append(Finding(o.node, CHECK, FAIL, "no result", f"{who}: {o.error}",
                                    f"check {o.node} and its Docker engine, then run `sparkctl check --fabric` again"))
            not_joined.append(str(o.rank))
            continue
        if err:
            findings.append(Finding(o.node, CHECK, FAIL, f"failed ({str(err.get('stage', '?'))[:20]})",
                                    f"{who}: failed at {err.get('stage')}: {str(err.get('error'))[:500]}",
                                    _fix_for(str(err.get("error", "")), o)))
        elif timeout:
            findings.append(Finding(o.node, CHECK, FAIL, "timed out",
                                    f"{who}: did not finish within {timeout_s:g} s (stuck at {timeout.get('stage')})",
                                    "the ranks named here never met: compare their fabric pins "
                                    f"(`sparkctl check`) and the firewall for {PORT_WORDS}"))
        elif o.event("done") is None and o.stopped_by is not None:
            findings.append(Finding(o.node, CHECK, FAIL, "stopped",
                                    f"{who}: stopped by sparkctl after rank {o.stopped_by} failed (the all-reduce "
                                    "cannot complete without it)", "see rank "
                                    f"{o.stopped_by}'s finding"))
        elif o.event("done") is None:
            tail = f": {o.output_tail[-1][:300]}" if o.output_tail else ""
            findings.append(Finding(o.node, CHECK, FAIL, "no result",
                                    f"{who}: the fabric program ended without a result (exit {o.exit_code}){tail}"))
        if o.event("joined") is None:
            not_joined.append(str(o.rank))
        if o.nccl is not None:
            for f in nccl.rank_findings(o.nccl, expect_rdma=fab.expect_rdma if fab.backend == "nccl" else None,
                                        check=CHECK):
                if f.status != OK:
                    findings.append(Finding(o.node, CHECK, f.status, f.short, f"{who}: {f.text}", f.fix))
        if o.event("done") is not None and not any(f.node == o.node and f.status == FAIL for f in findings):
            top = max(o.results, key=lambda e: e.get("bytes", 0), default=None)
            short = f"{top['busbw_gbps']:g} GB/s" if top else "ok"
            transport = nccl.describe(o.nccl) if o.nccl else f"{fab.backend}"
            findings.append(Finding(o.node, CHECK, OK, short, f"{who}: all-reduce ok, busbw {short} at "
                                    f"{top['bytes'] if top else '?'} B; {transport}"))
    if not_joined:
        findings.append(Finding(CLUSTER_ROW, CHECK, FAIL, "incomplete",
                                f"rank(s) {', '.join(not_joined)} never joined the all-reduce "
                                f"({len(outcomes) - len(not_joined)} of {len(outcomes)} did)",
                                "see each rank's finding above"))
    logs = []
    for o in outcomes:
        if o.nccl is not None:
            o.nccl.source = f"rank {o.rank} on {o.node}"
            logs.append(o.nccl)
    findings += nccl.version_findings(logs, check=CHECK, node=CLUSTER_ROW)
    if all(o.event("done") for o in outcomes):
        events = [e for o in outcomes for e in o.results]
        findings += nccl.floor_findings(events, fab.busbw_floor_gbps or None, check=CHECK, node=CLUSTER_ROW)
    return findings


def _fix_for(error: str, o: RankOutcome) -> str:
    low = error.lower()
    if "unable to find address for" in low or "no such device" in low or "socket_ifname" in low:
        return (f"the interface pinned for rank {o.rank} does not exist in the container on {o.node}: "
                f"check RANK{o.rank}_CX7_IF (`sparkctl check` discovers it)")
    if "duplicate gpu" in low:
        return "two ranks landed on one GPU: one rank per node, GPUS_PER_NODE and --gpus"
    if "connect" in low or "timed out" in low or "timeout" in low:
        return f"the rank could not reach the head's rendezvous: check the head's fabric IP and the firewall for {PORT_WORDS}"
    return "see the error; `sparkctl nccl-report` on the rank's output explains what NCCL chose"


def sweep(node: Node, cluster: str) -> int:
    """Remove this cluster's fabric-test containers on one node; returns how many there were."""
    r = node.run(["sh", "-c", _SWEEP, "sparkctl-sweep", f"{LABEL_CLUSTER}={cluster}", f"{LABEL_PURPOSE}={PURPOSE}"],
                 timeout=60)
    if not r.ok:
        first = next((ln for ln in r.stderr.splitlines() if ln.strip()), f"exit status {r.exit_code}")
        raise NodeError(node.name, "docker", f"could not remove the fabric-test containers: {first[:300]}",
                        f"on {node.name}: {sweep_by_hand(cluster)}")
    try:
        return int(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def _sweep_all(cluster: Cluster, settings: Settings) -> tuple[dict[str, int], dict[str, str]]:
    """Sweep every node on threads of its own (the fan-out pool may still be busy with `docker run`)."""
    swept: dict[str, int] = {}
    problems: dict[str, str] = {}

    def one(name: str) -> None:
        try:
            swept[name] = sweep(cluster.node(name), settings.cluster_name)
        except NodeError as exc:
            problems[name] = exc.reason
        except Exception as exc:  # a sweep must never hide the run's own result
            problems[name] = f"{type(exc).__name__}: {exc}"

    done = [spawn(functools.partial(one, n), f"fabric-sweep-{n}") for n in settings.nodes]
    for ended in done:  # up to 90 s each, as the sweeps run side by side; a Ctrl-C goes through
        ended.wait(90)
    return swept, problems


def run_fabric_test(cluster: Cluster, settings: Settings, pins: list[RankPins], *,
                    timeout_s: float | None = None, say: Callable[[str], None] = lambda s: None,
                    busy_ports: Iterable[int] = ()) -> FabricReport:
    """Run the test on every rank at once; always sweep afterwards, also on Ctrl-C (re-raised).
    `busy_ports`: what the head listens on (the rendezvous avoids them, and MASTER_PORT and PORT)."""
    fab = settings.recipe.fabric
    bound = float(timeout_s if timeout_s is not None else fab.timeout_s)
    program = probe_script(PROGRAM)
    port = fabric_port(settings, busy_ports)
    argv = {n: fabric_run_argv(settings, r, pins, timeout_s=bound, port=port) for r, n in enumerate(settings.nodes)}
    say(f"fabric test: {fab.backend} all-reduce on {len(argv)} rank(s) in {fabric_image(settings)} "
        f"(bound {bound:g} s; the ranks meet on the head's port {port})")
    start = time.monotonic()
    box: dict[str, Any] = {}

    first_failed: list[str] = []
    lock = threading.Lock()

    def note_failure(name: str) -> None:
        # Fail fast: the others would only wait for this rank until the bound. Stop them all now.
        with lock:
            first = not first_failed
            first_failed.append(name)
        if first:
            _sweep_all(cluster, settings)

    def one(node: Node) -> RunResult:
        try:
            res = node.run(argv[node.name], stdin=program, timeout=bound + START_ALLOWANCE_S)
        except NodeError:
            note_failure(node.name)
            raise
        if failed_early(res):
            note_failure(node.name)
        return res

    def fan_out() -> None:
        try:
            box["results"] = cluster.run_all(one, nodes=settings.nodes)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    worker: list[threading.Event] = []
    try:  # the start inside the try: a Ctrl-C can land while the thread starts, too
        worker.append(spawn(fan_out, "fabric-test"))
        wait_all(worker, 0.2)
    except KeyboardInterrupt:
        say("interrupted: removing the fabric-test containers on every node")
        _sweep_all(cluster, settings)
        # each docker run ends once its container is gone (an Event, not join: see sparkctl.threads)
        wait_bounded(worker, bound + START_ALLOWANCE_S)
        _sweep_all(cluster, settings)  # and once more for one created after the first sweep
        raise
    seconds = time.monotonic() - start
    swept, problems = _sweep_all(cluster, settings)
    if "error" in box:
        raise box["error"]
    results: dict[str, RunResult | NodeError] = box["results"]
    outcomes = [outcome_from_run(r, n, results[n]) for r, n in enumerate(settings.nodes)]
    if first_failed:
        culprit = settings.nodes.index(first_failed[0])
        for o in outcomes:
            # a rank whose engine lacks the image failed on its own: its error stays
            if o.rank != culprit and not o.events_say_why and not o.missing_image:
                o.stopped_by, o.error = culprit, None  # its container was removed by the sweep
    findings = evaluate(outcomes, fab, timeout_s=bound)
    for node, why in problems.items():
        findings.append(Finding(node, CHECK, WARN, "not cleaned", f"{node}: {why}",
                                f"remove them by hand on {node}: {sweep_by_hand(settings.cluster_name)}"))
    collective = max((float((o.event("done") or {}).get("total_s") or 0) for o in outcomes), default=0.0)
    return FabricReport(fab.backend, fabric_image(settings), outcomes, findings, seconds, collective, problems, swept)


def size_label(nbytes: int | str) -> str:
    n = int(nbytes)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def skipped(nodes: list[str], why: str) -> list[Finding]:
    return [Finding(n, CHECK, SKIP, "-", f"{n}: fabric test not run: {why}") for n in nodes]
