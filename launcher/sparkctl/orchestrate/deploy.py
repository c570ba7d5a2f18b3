"""`sparkctl deploy`'s flow: the existing flows chained, each behind a probe that says whether it has
anything to do.

  STEPS                       the ordered registry: setup, pull, sync, check, build, up, wait, report, supervise
    Step.applies(ctx)         None: part of this deploy; else why not (MODEL_REPO unset, one node, no
                              --supervise): listed in the plan as skipped, never probed
    Step.probe(ctx)           what it would do and why (StepPlan); changes nothing on any node
    Step.apply(ctx, plan)     the existing flow: setup.apply, model_pull.pull_on_head, model_sync.sync, check.run_check,
                              build.build, up.up, wait.wait, bench.run_bench, export_systemd.install_unit
  plan_steps(ctx)             every step's probe (a probe that fails says so: the step would run)
  apply_steps(ctx)            per step, in order: probe again (an earlier step changed the cluster), skip
                              when it has nothing to do, else apply; the first failure ends the run: the
                              failed step names its node and fix, the later ones are `not run`; a signal
                              is the step's own (its flow rolls back what it started, as the command
                              does) and ends the run the same way

A re-run after a failure or a signal completes from where it stopped: each probe reads the cluster as it is.

Adding a step is one entry in STEPS: Step(name, title, probe, apply, applies).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import signals
from ..cluster import Cluster, Node, NodeError
from ..errors import CheckFailed, SparkctlError, UsageError
from ..facts.parsing import ParseError, parse_json
from ..progress import Feed
from ..spec import deploy_plan as dp
from ..spec.settings import Settings
from ..spec.systemd_unit import UnitInstall

COMMIT_LEN = 40


@dataclass
class Context:
    """One deploy: the settings, where events go, the options, and what the probes already read."""

    settings: Settings
    ssh_config: Any
    feed: Feed
    say: Callable[[str], None] = lambda m: None
    supervise: bool = False
    bench: bool = True
    wait_timeout: float = 3600.0
    prompt: str = "Say hello in five words."
    # export systemd's unit, made by the command layer: (node, systemd_unit.UnitInstall)
    supervisor: Callable[[], tuple[str, UnitInstall]] | None = None
    state: dict[str, Any] = field(default_factory=dict)  # deploy's saved state (check's last pass)
    memo: dict[str, Any] = field(default_factory=dict)  # probe results shared between steps
    answer: dict[str, Any] | None = None  # wait's first completion (the report shows it: no second request)
    cluster: Cluster | None = None  # the probes' connections (one per node), opened on first use

    def nodes_cluster(self) -> Cluster:
        if self.cluster is None:
            self.cluster = Cluster(self.settings.nodes, self.ssh_config).__enter__()
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.__exit__(None, None, None)
            self.cluster = None

    def forget(self) -> None:
        """After a step changed the cluster: what the probes read is stale (the connections stay)."""
        self.memo.clear()


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    probe: Callable[[Context], dp.StepPlan]
    apply: Callable[[Context, dp.StepPlan], dict[str, Any]]
    applies: Callable[[Context], str | None] = lambda ctx: None


# ------------------------------------------------------------------------------------ the engine


def plan_steps(ctx: Context, steps: list[Step]) -> list[dict[str, Any]]:
    """Every step with what it would do and why. Nothing changes on any node."""
    out = []
    for step in steps:
        off = step.applies(ctx)
        if off is not None:
            out.append({"step": step.name, "title": step.title, **dp.StepPlan(False, off).as_dict()})
            continue
        ctx.feed.event(step.name, "probe", step.title)
        try:
            p = step.probe(ctx)
        except SparkctlError as exc:
            p = dp.StepPlan(True, f"cannot tell yet ({exc.message.splitlines()[0]}): it runs",
                            detail={"node": exc.node, "fix": exc.fix})
        out.append({"step": step.name, "title": step.title, **p.as_dict()})
        ctx.feed.event(step.name, "plan", p.why, level="info")
    return out


class DeployFailed(CheckFailed):
    """A step failed: the message names the step, its node and what was not run; `results` says the rest."""

    def __init__(self, results: list[dp.StepResult], cause: SparkctlError) -> None:
        failed = next(r for r in results if r.status == dp.FAILED)
        later = [r.step for r in results if r.status == dp.NOT_RUN]
        where = f" on {failed.node}" if failed.node else ""
        first, *rest = cause.message.splitlines() or [""]
        msg = (f"deploy failed at step {failed.step}{where}: {first}" + (f"; not run: {', '.join(later)}" if later else "")
               + "".join(f"\n{line}" for line in rest))  # the first line is the whole story; the cause's detail after
        own = cause.as_dict() if isinstance(cause, NodeError) else None  # one node's failure is its own row
        super().__init__(msg, fix=cause.fix, node=cause.node, failures=cause.failures or ([own] if own else None))
        self.exit_code = cause.exit_code
        self.results = results


def apply_steps(ctx: Context, steps: list[Step]) -> list[dp.StepResult]:
    """Run the steps that have something to do, in order; see the module's docstring."""
    results: list[dp.StepResult] = []
    for i, step in enumerate(steps):
        t0 = time.monotonic()
        off = step.applies(ctx)
        if off is not None:
            results.append(dp.StepResult(step.name, dp.SKIPPED, off))
            ctx.feed.event(step.name, "skip", off)
            continue
        try:
            ctx.feed.event(step.name, "probe", step.title)
            p = step.probe(ctx)
            if not p.todo:
                results.append(dp.StepResult(step.name, dp.SKIPPED, f"nothing to do: {p.why}",
                                             seconds=time.monotonic() - t0))
                ctx.feed.event(step.name, "skip", f"nothing to do: {p.why}")
                continue
            ctx.feed.event(step.name, "start", p.why)
            changed = step.apply(ctx, p)
            ctx.forget()
            results.append(dp.StepResult(step.name, dp.DONE, p.why, changed, seconds=time.monotonic() - t0))
            ctx.feed.event(step.name, "done", json.dumps(changed, default=str)[:500])
        except SparkctlError as exc:
            results.append(dp.StepResult(step.name, dp.FAILED, error=exc.message, node=exc.node, fix=exc.fix,
                                         seconds=time.monotonic() - t0))
            ctx.feed.event(step.name, "failed", exc.message, node=exc.node, level="error")
            results += _not_run(ctx, steps[i + 1:])
            raise DeployFailed(results, exc) from None
        except KeyboardInterrupt as exc:
            name = exc.name if isinstance(exc, signals.Interrupted) else "SIGINT"
            results.append(dp.StepResult(step.name, dp.FAILED, error=f"interrupted ({name}): the step's own "
                                         "rollback ran", fix="run `sparkctl deploy --yes` again: it completes "
                                         "from here", seconds=time.monotonic() - t0, interrupted=True))
            ctx.feed.event(step.name, "interrupted", name, level="error")
            results += _not_run(ctx, steps[i + 1:])
            exc.deploy_results = results  # type: ignore[attr-defined]
            raise
    return results


def _not_run(ctx: Context, rest: list[Step]) -> list[dp.StepResult]:
    out = []
    for s in rest:
        off = s.applies(ctx)
        if off is not None:  # not part of this deploy anyway
            out.append(dp.StepResult(s.name, dp.SKIPPED, off))
            continue
        out.append(dp.StepResult(s.name, dp.NOT_RUN, "an earlier step failed"))
        ctx.feed.event(s.name, "not-run", "an earlier step failed", level="warning")
    return out


# ------------------------------------------------------------------------------ shared reads


def _failed_node(exc: NodeError) -> CheckFailed:
    return CheckFailed(exc.reason, fix=exc.fix, node=exc.node)


def head_scan(ctx: Context) -> dict[str, Any]:
    """The checkpoint scan of every node (scan_node: fingerprints, no headers), read once per round."""
    if "scans" not in ctx.memo:
        from .model_sync import scan_node

        cluster = ctx.nodes_cluster()
        model = str(ctx.settings.model)
        ctx.memo["scans"] = cluster.run_all(lambda n: scan_node(n, model), nodes=ctx.settings.nodes)
    scans = ctx.memo["scans"]
    head = ctx.settings.head
    if head in scans.failed:
        raise _failed_node(scans.failed[head])
    doc: dict[str, Any] = scans.ok[head]
    return doc


def current_inputs(ctx: Context) -> dict[str, Any]:
    """The inputs of a plan now: the settings (secrets by presence), the recipe file, the head's checkpoint."""
    s = ctx.settings
    values = {k: v.value for k, v in s.values.items()}
    try:
        recipe = s.recipe.path.read_bytes()
    except OSError:
        recipe = b""
    try:
        fp = dp.checkpoint_fingerprint(head_scan(ctx))
    except SparkctlError:
        fp = None
    return dp.inputs(dp.settings_view(values, set(s.secrets())), recipe, fp)


# ------------------------------------------------------------------------------------------ pull


def _pull_applies(ctx: Context) -> str | None:
    return None if ctx.settings.get("MODEL_REPO") else "MODEL_REPO is unset: the checkpoint is taken as MODEL holds it"


def _read_marker(node: Node, model: str) -> dict[str, Any] | None:
    r = node.run(["cat", "--", f"{model.rstrip('/')}/.sparkctl-model.json"], timeout=20)
    if not r.ok:
        return None
    try:
        doc = parse_json(r.stdout)
    except ParseError:
        return None
    return doc if isinstance(doc, dict) else None


def probe_pull(ctx: Context) -> dp.StepPlan:
    s = ctx.settings
    repo, rev = str(s.get("MODEL_REPO")), str(s.get("MODEL_REVISION") or "")
    head = s.head
    if not rev:
        scan = head_scan(ctx)
        if scan.get("shards") and not scan.get("error"):
            return dp.StepPlan(False, f"no MODEL_REVISION pin: {head}:{s.model} is taken as it is")
        raise UsageError(f"MODEL_REVISION is unset and {head}:{s.model} holds no checkpoint: which revision of "
                         f"{repo} to pull?", fix="set MODEL_REVISION to the commit id to pin", node=head)
    marker = _read_marker(ctx.nodes_cluster().node(head), str(s.model))
    want = f"download {repo}@{rev} into {head}:{s.model}"
    if marker is None:
        return dp.StepPlan(True, f"{head}:{s.model} holds no pulled checkpoint", [want + " (size: the Hub's)"])
    if marker.get("repo") != repo or marker.get("revision") != rev:
        return dp.StepPlan(True, f"{head}:{s.model} holds {marker.get('repo')}@{marker.get('revision')}, "
                           f"the pin is {repo}@{rev}", [want])
    if len(rev) != COMMIT_LEN:
        return dp.StepPlan(True, f"MODEL_REVISION {rev} is a branch: the Hub says what it is now",
                           [want + " (only what changed)"])
    listed = {str(k): int(v) for k, v in (marker.get("files") or {}).items() if isinstance(v, int)}
    files = head_scan(ctx).get("files") or {}
    short = {n: size for n, size in listed.items() if (files.get(n) or {}).get("size") != size}
    if short:
        return dp.StepPlan(True, f"{len(short)} file(s) of the pin are missing or differ on {head}",
                           [want + f": {sum(short.values()):,} B"], {"bytes": sum(short.values()),
                                                                      "files": sorted(short)})
    return dp.StepPlan(False, f"{head}:{s.model} holds {repo}@{rev} ({len(listed)} files)")


def apply_pull(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from .model_pull import pull_on_head, raise_for_status, verify_head

    s = ctx.settings
    repo, rev = str(s.get("MODEL_REPO")), str(s.get("MODEL_REVISION"))
    doc = pull_on_head(s, ctx.ssh_config, repo, rev,
                       started=lambda head: ctx.feed.event("pull", "starting", f"{repo}@{rev}", node=head),
                       progress=lambda done, total, secs: ctx.feed.event("pull", "downloading", node=s.head,
                                                                         bytes_done=done, bytes_total=total))
    raise_for_status(doc, s, repo, rev)
    if doc.get("status") == "downloaded":
        report = verify_head(s, ctx.ssh_config, None)
        if not report.ok:
            raise CheckFailed(f"{s.head}:{s.model}: the downloaded checkpoint fails verify-model", node=s.head,
                              fix="`sparkctl verify-model` shows every finding")
    return {"node": s.head, "status": doc.get("status"), "commit": doc.get("commit"),
            "downloaded_bytes": doc.get("downloaded_bytes")}


# ----------------------------------------------------------------------------------------- setup


def probe_setup(ctx: Context) -> dp.StepPlan:
    """Nothing to do while every node's fabric document matches its ports (read without the cabling's neighbour
    discovery); else `sparkctl setup`'s own plan over the probes' connections: a step to run when it has
    changes (addresses, MTU, limits, earlyoom, sudoers, the document)."""
    from .setup import document_disagrees
    from .setup import plan as setup_plan

    stale = document_disagrees(ctx.nodes_cluster(), ctx.settings)
    if stale is None:
        return dp.StepPlan(False, "every node's fabric document matches its ports (`sparkctl setup` checks the rest)")
    report = setup_plan(ctx.nodes_cluster(), ctx.settings)
    ctx.memo["setup"] = report
    changes = report.changes
    if not changes:
        return dp.StepPlan(False, f"every node is as setup leaves it (cabling: {report.cabling.layout}; the fabric "
                                  "document matches)", detail={"layout": report.cabling.layout})
    nodes = sorted({c["node"] for c in changes})
    would = [f"{c['node']}: {c['what']}" + (f" ({c.get('path') or c.get('command')})"
                                            if c.get("path") or c.get("command") else "") for c in changes]
    return dp.StepPlan(True, f"{stale}: {len(changes)} change(s) on {', '.join(nodes)} (`sparkctl setup` shows each "
                             "file)", would, {"layout": report.cabling.layout, "changes": changes})


def apply_setup(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from .setup import apply as setup_apply
    from .setup import plan as setup_plan

    report = ctx.memo.get("setup") or setup_plan(ctx.nodes_cluster(), ctx.settings)
    report = setup_apply(ctx.nodes_cluster(), ctx.settings, report, ctx.ssh_config)
    outcomes = report.applied or {}
    for n, o in outcomes.items():
        ctx.feed.event("setup", o.status, ", ".join(o.wrote + o.ran) or o.status, node=n)
    if report.failed:
        first = outcomes[report.failed[0]]
        raise CheckFailed(f"setup failed on {', '.join(report.failed)}: {first.error or first.status}",
                          node=report.failed[0] if len(report.failed) == 1 else None,
                          fix=first.fix or "run `sparkctl setup` to see each node's fix",
                          failures=[{"node": n, "kind": outcomes[n].status, "reason": outcomes[n].error or "",
                                     "fix": outcomes[n].fix or ""} for n in report.failed])
    return {"nodes": {n: o.as_dict() for n, o in outcomes.items()}}


# ------------------------------------------------------------------------------------------ sync


def _sync_applies(ctx: Context) -> str | None:
    return None if len(ctx.settings.nodes) > 1 else "one node: nothing to copy"


def probe_sync(ctx: Context) -> dp.StepPlan:
    from ..checkpoint.sync_plan import plan_bytes, plan_files, same_folder
    from .model_sync import describe_node

    s = ctx.settings
    src = head_scan(ctx)
    if src.get("error") or not src.get("shards"):
        return dp.StepPlan(True, f"{s.head}:{s.model} holds no checkpoint yet (the pull brings it)",
                           [f"copy the checkpoint to {', '.join(s.nodes[1:])}"])
    scans = ctx.memo["scans"]
    descs = ctx.nodes_cluster().run_all(lambda n: describe_node(n, str(s.model)), nodes=s.nodes)
    if s.head in descs.failed:
        raise _failed_node(descs.failed[s.head])
    would, per_rank, shared = [], {}, []
    for t in s.nodes[1:]:
        for got in (scans, descs):
            if t in got.failed:
                raise _failed_node(got.failed[t])
        if same_folder(descs.ok[s.head], descs.ok[t]):
            shared.append(t)  # the head's own folder (NFS): nothing to copy, and sync would refuse
            continue
        dst = scans.ok[t]
        files = plan_files(src, dst if not dst.get("error") else None)
        if files:
            per_rank[t] = {"files": len(files), "bytes": plan_bytes(src, files)}
            would.append(f"{t}: copy {len(files)} file(s), {per_rank[t]['bytes']:,} B")
    note = f" ({', '.join(shared)} share{'s' if len(shared) == 1 else ''} its folder)" if shared else ""
    if not per_rank:
        return dp.StepPlan(False, f"every rank holds {s.head}'s checkpoint{note}", detail={"shared": shared})
    if len(per_rank) > 1:
        would.append(f"along the chain {' -> '.join([s.head, *per_rank])}: {s.head} sends one copy, each rank "
                     "forwards to the next as it receives")
    return dp.StepPlan(True, f"{len(per_rank)} rank(s) lack files of {s.head}'s checkpoint or differ{note}", would,
                       {"ranks": per_rank, "shared": shared})


def apply_sync(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    import threading

    from .model_sync import sync

    s = ctx.settings
    ranks = {n: i for i, n in enumerate(s.nodes)}

    def progress(r: Any) -> None:
        ctx.feed.event("sync", "copying" if r.status == "pending" else r.status, r.message, node=r.node,
                       rank=ranks.get(r.node), bytes_done=r.bytes_done, bytes_total=r.need_bytes)

    only = sorted(plan.detail.get("ranks") or {}) or None  # a rank sharing the head's folder is left out
    report = sync(s, ctx.ssh_config, progress=progress, stop=threading.Event(), only=only)
    if report.interrupted:
        got = signals.received()
        raise signals.Interrupted(got[-1] if got else 2)
    if not report.ok:
        bad = [r for r in report.ranks.values() if r.status not in ("up-to-date", "complete")]
        first = bad[0] if bad else None
        raise CheckFailed("model sync did not complete: " + "; ".join(f"{r.node}: {r.status} {r.message}" for r in bad)
                          + "".join(f"; {f.reason}" for f in report.findings if f.severity == "fail"),
                          node=first.node if first else None,
                          fix="run `sparkctl deploy --yes` again (the copy resumes), or `sparkctl model sync`")
    return {"ranks": {r.node: {"status": r.status, "files": len(r.files), "bytes_sent": r.bytes_sent, "from": r.via}
                      for r in report.ranks.values()}}


# ----------------------------------------------------------------------------------------- check


def probe_check(ctx: Context) -> dp.StepPlan:
    key = dp.inputs_key(current_inputs(ctx))
    if ctx.state.get("check_passed") == key:
        return dp.StepPlan(False, "it passed with these very inputs (settings, recipe, checkpoint)")
    return dp.StepPlan(True, "these inputs were not checked yet", ["preflight every node (reads only)"])


def apply_check(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from .check import run_check

    s = ctx.settings
    report = run_check(s, ctx.ssh_config, cluster=ctx.nodes_cluster())
    failed, replaced = blocking_findings(report.failed)
    if failed:
        first = failed[0]
        raise CheckFailed("check failed: " + "; ".join(f.text if f.text.startswith(f"{f.node}:") else f"{f.node}: {f.text}"
                                             for f in failed[:5])
                          + (f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""),
                          node=first.node, fix=first.fix or "`sparkctl check` shows every finding")
    ctx.state["check_passed"] = dp.inputs_key(current_inputs(ctx))
    out: dict[str, Any] = {"warnings": len(report.warnings)}
    if replaced:
        out["running_service"] = "this cluster's service runs: the up step replaces it (its containers and ports)"
    return out


# What this cluster's own running service makes `check` fail: its containers, and the head's PORT and
# MASTER_PORT it listens on. A deploy that changes a knob replaces that service in its up step, so these
# are expected there; every other failure still stops the deploy.
SERVICE_CHECKS = ("containers", "ports")


def blocking_findings(failed: list[Any]) -> tuple[list[Any], bool]:
    """The failures that stop a deploy, and whether this cluster's own service runs (its `containers`
    failure: check's rule fails only on running containers labelled with this cluster). The head's ports are
    forgiven only then: with no service of ours running, a taken port is someone else's."""
    own = any(f.check == "containers" for f in failed)
    if not own:
        return failed, False
    return [f for f in failed if f.check not in SERVICE_CHECKS], True


# ----------------------------------------------------------------------------------------- build


def probe_build(ctx: Context) -> dp.StepPlan:
    from .build import build

    done = build(ctx.settings, ctx.ssh_config, ship=False, only=None, no_cache=False, dry_run=True,
                 progress=lambda nodes, layers: _FeedBoard(ctx, nodes))
    todo, lines = dp.build_todo(done.out.get("plan") or {}, done.out.get("base"))
    if not todo:
        return dp.StepPlan(False, f"every rank has {ctx.settings.image}", lines)
    return dp.StepPlan(True, f"{ctx.settings.image} is missing or stale on a rank", [ln for ln in lines
                       if "up to date" not in ln and not ln.split(": ", 1)[-1].startswith(("nothing", "has "))],
                       {"plan": done.out.get("plan")})


class _FeedBoard:
    """build's progress board (orchestrate.build.Progress) as events: one per layer state per rank."""

    def __init__(self, ctx: Context, nodes: Sequence[str]) -> None:
        self.ctx = ctx
        self.ranks = {n: i for i, n in enumerate(nodes)}

    def __enter__(self) -> _FeedBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, node: str, layer: str, text: str, *, event: bool = True) -> None:
        if event:
            self.ctx.feed.event("build", f"{layer} {text.split(' ')[0]}", text, node=node, rank=self.ranks.get(node))

    def note(self, node: str, text: str) -> None:
        self.ctx.feed.event("build", "note", text, node=node, rank=self.ranks.get(node))


def apply_build(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from .build import build

    done = build(ctx.settings, ctx.ssh_config, ship=False, only=None, no_cache=False, dry_run=False,
                 progress=lambda nodes, layers: _FeedBoard(ctx, nodes))
    failed = [r for r in done.results.values() if not r.ok]
    if failed:
        raise CheckFailed(f"build failed on {len(failed)} rank(s): "
                          + "; ".join(f"{r.node}: {r.error}" for r in failed), node=failed[0].node,
                          fix=failed[0].fix or "`sparkctl build` shows each layer's log tail")
    return {r.node: {"built": [x.layer for x in r.layers.values() if x.action == "built"],
                     "image_id": r.image_id} for r in done.results.values()}


# -------------------------------------------------------------------------------------------- up


def probe_up(ctx: Context) -> dp.StepPlan:
    from ..remote import service
    from .up import render_with_plan

    s = ctx.settings
    cluster = ctx.nodes_cluster()
    from . import require_all

    require_all(cluster, "deploy")
    got = cluster.run_all(lambda n: service.node_state(n, s.cluster_name, s.image), nodes=s.nodes)
    if got.failed:
        n, e = next(iter(got.failed.items()))
        raise CheckFailed(e.reason, fix=e.fix, node=n)
    states = {n: g[0] for n, g in got.ok.items()}
    images = {n: g[1] for n, g in got.ok.items()}
    running = sorted({c.config_hash for cs in states.values() for c in cs if c.running and c.config_hash})
    ctx.memo["running_config"] = running
    missing = [n for n in s.nodes if images.get(n) is None]
    if missing:
        return dp.StepPlan(True, f"{s.image} is not on {', '.join(missing)} yet (the build brings it)",
                           [f"start {len(s.service.ranks)} rank(s) once the image is there"],
                           {"replace": running})
    rendered, plan, _ = render_with_plan(cluster, s, "sparkctl deploy")
    reasons = service.diff_running(rendered.specs, rendered.config_hash, states, images)
    need = {r.node: plan.per_rank_total * s.topology.gpus_per_node for r in s.service.ranks}
    ctx.memo["memory"] = need
    if not reasons:
        ctx.memo["up_done"] = True
        return dp.StepPlan(False, f"the service runs config {rendered.config_hash} with {s.image} on every rank",
                           detail={"config_hash": rendered.config_hash})
    replace = [c.name for cs in states.values() for c in cs]
    would = [f"replace {len(replace)} container(s): {', '.join(replace)}"] if replace else []
    would.append(f"start {len(rendered.specs)} rank(s), config {rendered.config_hash}")
    would += [f"{n}: wait for {b / 2**30:.1f} GiB of memory" for n, b in need.items()]
    return dp.StepPlan(True, "; ".join(reasons[:4]) + (f" (and {len(reasons) - 4} more)" if len(reasons) > 4 else ""),
                       would, {"config_hash": rendered.config_hash, "replace": replace, "memory_bytes": need})


def apply_up(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from .up import up

    s = ctx.settings
    previous = plan.detail.get("replace") and ctx.memo.get("running_config")
    try:
        outcome = up(s, ctx.ssh_config, recreate=False, say=lambda m: ctx.feed.event("up", "up", m))
    finally:
        # up's point of no return (signals.commit) ends at its return: the later steps are interruptible
        signals.reopen()
    changed: dict[str, Any] = {"config_hash": outcome.config_hash, "started": outcome.started,
                               "reasons": outcome.reasons}
    if previous:
        changed["rollback_point"] = {"config_hash": previous[0],
                                     "how": "`sparkctl rollback` returns to it (`sparkctl history` lists it)"}
    return changed


# ------------------------------------------------------------------------------------------ wait


def probe_wait(ctx: Context) -> dp.StepPlan:
    from ..remote import readiness, service

    s = ctx.settings
    memory = ctx.memo.get("memory") or {}
    if not ctx.memo.get("up_done"):
        return dp.StepPlan(True, "the service starts in this deploy: the engine loads on every rank",
                           [f"{n}: wait for the engine to load ({b / 2**30:.1f} GiB)" for n, b in memory.items()]
                           or ["wait for the engine to load on every rank"])
    api = readiness.HeadApi(service.head_base_url(ctx.nodes_cluster(), s), s.get("VLLM_API_KEY"), timeout=3)
    if api.health() != 200:
        return dp.StepPlan(True, f"{api.base_url}/health does not answer 200", ["wait until it serves"])
    try:
        models = api.models()
    except Exception as exc:  # an odd answer: wait sorts it out
        return dp.StepPlan(True, f"/v1/models failed: {exc}"[:200], ["wait until it serves"])
    served = str(s.get("SERVED_MODEL_NAME") or "")
    if served and served not in models:
        return dp.StepPlan(True, f"/v1/models does not list {served}", ["wait until it serves"])
    ctx.memo["api"] = {"url": api.base_url, "models": models}
    return dp.StepPlan(False, f"{api.base_url} serves {', '.join(models)}")


def apply_wait(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from .wait import wait

    def on_phase(w: Any) -> None:
        took = f" ({w.history[-1][0]} took {w.history[-1][1]:.1f}s)" if w.history else ""
        ctx.feed.event("wait", w.phase, f"{w.phase}{took}", node=w.node, rank=w.rank)

    url, result = wait(ctx.settings, ctx.ssh_config, url=None, timeout=ctx.wait_timeout, prompt=ctx.prompt,
                       on_phase=on_phase)
    ctx.answer = {"url": url, **result}
    return {"url": url, "elapsed_s": result.get("elapsed_s"), "models": result.get("models")}


# ---------------------------------------------------------------------------------------- report

BENCH_LEVELS = (1, 4)
BENCH_TOKENS = 64
ANSWER_TOKENS = 12
"""The report's completion when `wait` did not run (the service was already serving): a proof that it still
answers, long enough for the prompt's five words, not a measure (the short bench is that). After a `wait`
the report shows wait's own completion."""


def probe_report(ctx: Context) -> dp.StepPlan:
    return dp.StepPlan(True, "the answer of a deploy", ["one real completion"] + (
        [f"a short bench: C={', C='.join(map(str, BENCH_LEVELS))}, {max(BENCH_LEVELS)} requests each, "
         f"{BENCH_TOKENS} tokens"] if ctx.bench else []))


def apply_report(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from ..remote import readiness, service

    s = ctx.settings
    ready = ctx.answer
    if ready is None:
        api = readiness.HeadApi(service.head_base_url(ctx.nodes_cluster(), s), s.get("VLLM_API_KEY"))
        models = api.models()
        served = str(s.get("SERVED_MODEL_NAME") or "") or (models[0] if models else "")
        text, latency = api.chat(served, ctx.prompt, max_tokens=ANSWER_TOKENS)
        ready = {"url": api.base_url, "models": models, "completion": text, "latency_s": latency}
    served = str(s.get("SERVED_MODEL_NAME") or "") or (ready["models"][0] if ready.get("models") else "")
    out: dict[str, Any] = {"url": ready["url"], "model": served, "completion": str(ready.get("completion", "")).strip(),
                           "latency_s": round(float(ready.get("latency_s") or 0), 3)}
    if ctx.bench:
        out["bench"] = short_bench(ctx, ready["url"], served)
    return out


def short_bench(ctx: Context, url: str, model: str) -> dict[str, Any]:
    """C=1 and C=4 decode tok/s per stream and TTFT p50: bench's own flow, bounded (a few requests, 64 tokens)."""
    from ..loadgen.level import BenchConfig
    from ..remote.headapi import Endpoint
    from .bench import run_bench

    cfg = BenchConfig(endpoint=Endpoint.parse(url), model=model, api_key=ctx.settings.get("VLLM_API_KEY"),
                      concurrency=list(BENCH_LEVELS), requests=max(BENCH_LEVELS), warmup=1,
                      max_tokens=BENCH_TOKENS, timeout=60.0)
    cfg.workloads = cfg.workloads[:1]
    run = run_bench(cfg)
    doc = run.to_dict()
    levels: list[dict[str, Any]] = next(iter(doc.get("workloads", {}).values()), [])
    out: dict[str, Any] = {}
    for lv in levels:
        c = lv.get("concurrency")
        out[f"c{c}_tok_s"] = (lv.get("per_stream_tok_s") or {}).get("mean")
        out[f"c{c}_ttft_s"] = (lv.get("ttft_s") or {}).get("p50")
    if run.interrupted:
        raise signals.Interrupted(signals.received()[-1] if signals.received() else 2)
    return out


# ------------------------------------------------------------------------------------- supervise


def _supervise_applies(ctx: Context) -> str | None:
    return None if ctx.supervise else "--supervise not given"


def probe_supervise(ctx: Context) -> dp.StepPlan:
    assert ctx.supervisor is not None
    target, unit = ctx.supervisor()
    name, text = unit.name, unit.text
    node = ctx.nodes_cluster().node(target)
    r = node.run(["cat", "--", f"/etc/systemd/system/{name}"], timeout=20)
    if r.ok and r.stdout == text:
        active = node.run(["systemctl", "is-active", "--quiet", name], timeout=20)
        if active.ok:
            return dp.StepPlan(False, f"{name} on {target} is this unit, and active")
    return dp.StepPlan(True, f"{name} on {target} is absent, another unit or not active",
                       [f"install and start {name} on {target}"])


def apply_supervise(ctx: Context, plan: dp.StepPlan) -> dict[str, Any]:
    from .export_systemd import install_unit

    assert ctx.supervisor is not None
    target, unit = ctx.supervisor()
    install_unit(ctx.ssh_config, target, ctx.settings.cluster_name, unit)
    return {"unit": unit.name, "node": target, "recipe": unit.recipe}


# ------------------------------------------------------------------------------------ the registry

STEPS: list[Step] = [
    Step("setup", "setup: fabric addresses, limits, earlyoom, the fabric document", probe_setup, apply_setup),
    Step("pull", "model pull: the pinned checkpoint on the head", probe_pull, apply_pull, _pull_applies),
    Step("sync", "model sync: the head's checkpoint on every rank", probe_sync, apply_sync, _sync_applies),
    Step("check", "check: every node's preflight", probe_check, apply_check),
    Step("build", "build: the image on every rank", probe_build, apply_build),
    Step("up", "up: the service, started or replaced", probe_up, apply_up),
    Step("wait", "wait: the engine loaded, serving", probe_wait, apply_wait),
    Step("report", "report: the address, one completion, a short bench", probe_report, apply_report),
    Step("supervise", "export systemd: the supervisor on the head", probe_supervise, apply_supervise,
         _supervise_applies),
]
