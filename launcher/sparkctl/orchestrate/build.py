"""`sparkctl build`'s flow (`build`): the image chain on every rank (flags and printing: commands/build.py).

Default: every rank builds the chain itself, all ranks at once (its build context is staged on the
node from its own $MODEL/serving/, see sparkctl.image.chain). A layer whose content hash matches the image
already on the node is skipped, so a no-change build costs one probe per rank.

--ship: only the head builds; every other rank is sent just the layers it lacks. The head saves the
chain once; for each distinct need (usually one: all ranks are alike) the head packs the missing
members into one compressed stream, and this machine fans that stream out to the ranks' `docker load`
in parallel, over the SSH connections sparkctl already holds. Why through here and not head -> rank:
sparkctl assumes only operator -> node SSH; nodes need no credentials for each other and no open
port, and the content is verified at the end by image ID (IDs are content hashes). The cost is this
machine's bandwidth for what is shipped, which for the chain's layers (patches on a base every rank
already has) is small. Afterwards the image IDs of every chain tag are compared on all ranks.

Every rank ends with a result or a named failure; the others finish. Exit 1 if any rank failed.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..cluster import Cluster, Node, NodeError, Results, Stream, StreamLost, parallel
from ..errors import CheckFailed
from ..facts.docker_parse import Image, normalize_image_ref, parse_image_inspect
from ..facts.parsing import ParseError
from ..image import base_image as base_identity
from ..image import chain as im
from ..spec.resources import probe_script
from .locking import lock_cluster

BUILD_TIMEOUT = 3 * 3600.0  # one layer (v145 compiles CUDA kernels on a real node)
PULL_TIMEOUT = 3600.0
STALL_TIMEOUT = 600.0  # a ship stream with no byte moving for this long has failed
CHUNK = 256 * 1024


# ------------------------------------------------------------------------------------ results


@dataclass
class LayerResult:
    layer: str
    action: str  # skip | built | keep | stale | blocked | failed | pending
    reason: str = ""
    seconds: float = 0.0
    image_id: str | None = None
    versions: dict[str, str] | None = None  # what the built image reports (images.VERSIONS_SCRIPT)


@dataclass
class RankResult:
    node: str
    rank: int
    layers: dict[str, LayerResult] = field(default_factory=dict)
    error: str | None = None
    fix: str | None = None
    image_id: str | None = None
    shipped_bytes: int = 0
    shipped_layers: int = 0
    ship_note: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, NodeError):
            self.error, self.fix = exc.reason, exc.fix
        elif isinstance(exc, CheckFailed):
            self.error, self.fix = exc.message, exc.fix
        else:
            self.error = f"{type(exc).__name__}: {exc}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node, "rank": self.rank, "ok": self.ok, "error": self.error, "fix": self.fix,
            "image_id": self.image_id,
            "layers": [vars(r) for r in self.layers.values()],
            "shipped": {"bytes": self.shipped_bytes, "layers": self.shipped_layers, "note": self.ship_note},
        }


class Progress(Protocol):
    """Per-rank, per-layer progress (the command's `Board`): entered for the build, told each step."""

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> None: ...
    def set(self, node: str, layer: str, text: str, *, event: bool = True) -> None: ...
    def note(self, node: str, text: str) -> None: ...


ProgressFactory = Callable[[Sequence[str], Sequence[str]], Progress]  # (nodes, layer columns) -> Progress


@dataclass
class Outcome:
    """What a build did: `out` is the --json document less `ok` and `ranks` (taken from `results`);
    `plan_only` for a --dry-run (`out["plan"]` says what would happen)."""

    out: dict[str, Any]
    results: dict[str, RankResult]
    plan_only: bool = False


# ------------------------------------------------------------------------------------ remote helpers


def run_lines(node: Node, argv: Sequence[str], *, stdin: bytes, timeout: float,
              on_line: Callable[[str], None]) -> tuple[int, list[str]]:
    """Run argv with stdin, calling on_line for each output line (stdout+stderr); (exit code, last lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=30)
    deadline = time.monotonic() + timeout
    try:
        with node.open_stream(argv, merge_stderr=True, timeout=timeout) as s:
            s.write(stdin)
            s.close_input()
            buf = b""
            while True:
                if time.monotonic() > deadline:
                    raise NodeError(node.name, "command-timeout", f"no result within {timeout:g}s",
                                    f"check what hangs on {node.name}")
                got, _ = s.read(0.5)
                buf += got
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", errors="replace").rstrip("\r")
                    tail.append(line)
                    on_line(line)
                if not got and s.exited:
                    break
            if buf:
                tail.append(buf.decode("utf-8", errors="replace"))
            return s.exit_status(), list(tail)
    except StreamLost as exc:
        raise NodeError(node.name, "lost", f"SSH connection lost: {exc.cause}", "check the node and run the command again") from None


def inspect_images(node: Node, refs: Sequence[str]) -> list[Image]:
    res = node.docker(["image", "inspect", *refs], timeout=60)
    if not res.ok and "No such" not in res.stderr and "no such" not in res.stderr:
        raise NodeError(node.name, "docker", f"docker image inspect failed: {res.stderr.strip()[:300]}",
                        f"check the Docker engine on {node.name}")
    try:
        return parse_image_inspect(res.stdout)
    except ParseError as exc:
        raise NodeError(node.name, "output", f"docker image inspect: {exc}") from None


def _error_tail(tail: Sequence[str]) -> str:
    useful = [ln for ln in tail if ln.strip() and "DEPRECATED" not in ln and "buildx" not in ln
              and "BuildKit" not in ln and not ln.strip().startswith("https://")]
    return " | ".join(useful[-4:])[-600:]


# ------------------------------------------------------------------------------------ the flow


@dataclass
class Job:
    recipe: Any
    chains: dict[str, list[im.LayerSpec]]  # per node: the chain as its own serving/ defines it
    model: str
    base_ref: str
    only: str | None
    no_cache: bool
    board: Progress


def build_rank(node: Node, facts: im.RankFacts, job: Job, result: RankResult) -> None:
    """Build the chain on one node, deciding each layer with the real parent ID as it goes."""
    chain = job.chains[node.name]
    base = facts.image(job.base_ref)
    if base is None:
        first = chain[0].name
        job.board.set(node.name, first, "pulling base")
        res = node.docker(["pull", job.base_ref], timeout=PULL_TIMEOUT)
        got = inspect_images(node, [job.base_ref]) if res.ok else []
        if not got:
            why = _error_tail(res.stderr.splitlines() or res.stdout.splitlines()) or f"exit {res.exit_code}"
            raise NodeError(node.name, "docker", f"base image {job.base_ref} is not on the node and cannot be pulled: {why}",
                            f"load or pull {job.base_ref} on {node.name}, or set BASE_IMAGE")
        base = got[0]
    parent_id: str | None = base.id  # what the next layer is built FROM
    parent_hash: str | None = im.parent_key(base)  # what the next layer's content hash says of it
    rebuilt = False
    for layer in chain:
        existing = facts.image(layer.tag)
        if job.only is not None and layer.name != job.only:
            action = "stale" if rebuilt else "keep"
            result.layers[layer.name] = LayerResult(layer.name, action, f"--only {job.only}")
            job.board.set(node.name, layer.name, action, event=False)
            parent_id = existing.id if existing and not rebuilt else None
            parent_hash = im.parent_key(existing) if existing and not rebuilt else None
            continue
        if parent_id is None or parent_hash is None:
            prev = chain[layer.index - 1].tag
            result.layers[layer.name] = LayerResult(layer.name, "blocked", f"{prev} is not on the node")
            raise NodeError(node.name, "build", f"layer {layer.name}: its parent {prev} is not on the node",
                            "run `sparkctl build` without --only to build the chain")
        step = im.decide(layer, facts.digests, parent_hash, existing, no_cache=job.no_cache)
        if step.action == "skip" and existing is not None:
            result.layers[layer.name] = LayerResult(layer.name, "skip", step.reason, image_id=existing.id)
            job.board.set(node.name, layer.name, "skip", event=False)
            parent_id, parent_hash = existing.id, im.parent_key(existing)
            continue
        assert step.content_hash is not None
        start = time.monotonic()
        job.board.set(node.name, layer.name, "building")

        def progress(line: str, layer_name: str = layer.name, t0: float = start) -> None:
            step_no = im.build_step(line)
            if step_no:
                job.board.set(node.name, layer_name, f"building {step_no[0]}/{step_no[1]}", event=False)

        argv = im.build_argv(job.recipe, layer, job.model, facts.digests, parent_id, step.content_hash,
                             no_cache=job.no_cache)
        code, tail = run_lines(node, argv, stdin=layer.dockerfile, timeout=BUILD_TIMEOUT, on_line=progress)
        seconds = time.monotonic() - start
        if code != 0:
            result.layers[layer.name] = LayerResult(layer.name, "failed", _error_tail(tail), seconds)
            job.board.set(node.name, layer.name, "failed")
            raise NodeError(node.name, "build", f"layer {layer.name}: docker build failed (exit {code}): {_error_tail(tail)}",
                            f"fix {im.serving_dir(job.model)}/{layer.dockerfile_name} or what it copies on {node.name}")
        built = inspect_images(node, [layer.tag])
        if not built:
            raise NodeError(node.name, "build", f"layer {layer.name}: built, but {layer.tag} is not there")
        versions = layer_versions(node, layer)
        code, tail = run_lines(node, im.label_versions_argv(layer.tag, versions), stdin=f"FROM {built[0].id}\n".encode(),
                               timeout=300, on_line=lambda line: None)
        labelled = inspect_images(node, [layer.tag]) if code == 0 else []
        if not labelled:
            raise NodeError(node.name, "build", f"layer {layer.name}: recording its versions failed (exit {code}): "
                            f"{_error_tail(tail)}", f"check the Docker engine on {node.name}")
        built = labelled
        result.layers[layer.name] = LayerResult(layer.name, "built", step.reason, round(seconds, 2), built[0].id,
                                                versions)
        job.board.set(node.name, layer.name, f"built {seconds:.1f}s")
        parent_id, parent_hash = built[0].id, step.content_hash
        rebuilt = True
    top = inspect_images(node, [chain[-1].tag])
    result.image_id = top[0].id if top else None


def layer_versions(node: Node, layer: im.LayerSpec) -> dict[str, str]:
    """Run the version probe in a layer just built; a version the recipe expects and the image lacks
    fails this rank here, not the service later."""
    res = node.docker(im.versions_argv(layer.tag), timeout=300)
    try:
        versions = im.parse_versions(res.stdout)
    except (ParseError, ValueError):
        raise NodeError(node.name, "build", f"layer {layer.name}: the version probe failed (exit {res.exit_code}): "
                        f"{res.stderr.strip()[-300:]}", f"check that {layer.tag} has python3") from None
    problems = im.version_problems(dict(layer.expect), versions)
    if problems:
        raise NodeError(node.name, "build", f"layer {layer.name}: {'; '.join(problems)}",
                        f"fix serving/{layer.dockerfile_name} (or the recipe's expect for {layer.name})")
    return versions


def compare_versions(results: dict[str, RankResult], head: str) -> None:
    """Every rank that built a layer must report the same versions for it as the head (or the first)."""
    layers = {name for r in results.values() for name in r.layers}
    for name in sorted(layers):
        by_rank = {n: v for n, r in results.items()
                   if r.ok and name in r.layers and (v := r.layers[name].versions) is not None}
        for n, diff in im.version_disagreements(by_rank, head).items():
            results[n].error = f"layer {name} reports other versions than on the head: {diff}"
            results[n].fix = f"the ranks build different things: compare $MODEL/serving/ on {n} with the head's"


def probe(cluster: Cluster, chain: Sequence[im.LayerRef], model: str, base_ref: str) -> Results[im.RankFacts]:
    argv = im.probe_argv(model, chain, [base_ref, *(layer.tag for layer in chain)])

    def one(node: Node) -> im.RankFacts:
        res = node.run(argv, timeout=60)
        try:
            return im.parse_probe(res.stdout)
        except ParseError as exc:
            raise NodeError(node.name, "output", f"build probe: {exc}; stderr: {res.stderr.strip()[:300]}") from None

    return cluster.run_all(one)


def build(settings: Any, ssh_config: Any, *, ship: bool, only: str | None, no_cache: bool, dry_run: bool,
          progress: ProgressFactory) -> Outcome:
    """The chain on every rank (or built once on the head and shipped, `ship`); a prebuilt recipe's image
    given to every rank (`prebuilt`). `dry_run`: the plan only, nothing changed."""
    recipe = settings.recipe
    if recipe.prebuilt is not None:
        return prebuilt(settings, ssh_config, ship=ship, dry_run=dry_run, progress=progress)
    chain = im.load_chain(recipe)
    im.select_layers(chain, only)  # an unknown --only is a usage error before any connection
    nodes: list[str] = settings.nodes
    model = str(settings.model)
    base_ref = str(settings.get("BASE_IMAGE"))
    builders = [nodes[0]] if ship else nodes
    results = {n: RankResult(n, i) for i, n in enumerate(nodes)}
    out: dict[str, Any] = {"recipe": recipe.name, "mode": "ship" if ship else "build", "dry_run": dry_run,
                           "top": chain[-1].tag}
    with Cluster(nodes, ssh_config) as cluster, _locked(cluster, settings, "build", dry_run):
        facts = probe_facts(cluster, chain, model, base_ref, results)
        chains: dict[str, list[im.LayerSpec]] = {}
        problems: dict[str, list[str]] = {}
        for n in builders:
            if n in facts:
                chains[n], trouble = facts[n].chain(chain)
                if trouble:
                    problems[n] = trouble
        if problems:
            raise im.chain_error(problems, model)
        if dry_run:
            head_base = facts[nodes[0]].image(base_ref) if nodes[0] in facts else None
            if head_base is not None:
                p = base_identity.identify(base_ref, head_base)
                out["base"] = {**p.as_dict(), "stale": {n: why for n in nodes[1:] if n in facts
                                                        if (why := base_identity.stale(p, facts[n].image(base_ref)))}}
            out["plan"] = _plan(chain, chains, facts, results, builders, base_ref, only, no_cache, ship)
            return Outcome(out, results, plan_only=True)
        board = progress(nodes, [layer.name for layer in chain])
        job = Job(recipe, chains, model, base_ref, only, no_cache, board)
        with board:
            base = align_base(cluster, facts, results, base_ref, board)
            if base is not None:
                out["base"] = base
            todo = [n for n in builders if results[n].ok]

            def one(node: Node) -> None:
                try:
                    build_rank(node, facts[node.name], job, results[node.name])
                except Exception as exc:
                    results[node.name].fail(exc)
                    board.note(node.name, f"FAILED: {results[node.name].error}")
                    raise

            cluster.run_all(one, nodes=todo)
            if ship:
                head = nodes[0]
                if results[head].ok:
                    out["ship"] = ship_chain(cluster, chain, facts, results, board)
                else:
                    for n in nodes[1:]:
                        if results[n].ok:
                            results[n].error = f"not shipped: the head {head} failed to build"
        verify(cluster, chain, results, ship)
        compare_versions(results, nodes[0])
        _retain(cluster, settings, chain, results, out)
    return Outcome(out, results)


def _locked(cluster: Cluster, settings: Any, command: str, dry_run: bool) -> AbstractContextManager[Any]:
    """The cluster lock on every rank that answered (a plan only, --dry-run, changes nothing: no lock)."""
    if dry_run:
        return nullcontext()
    return lock_cluster(cluster, settings.nodes, settings.cluster_name, command)


def probe_facts(cluster: Cluster, chain: Sequence[im.LayerRef], model: str, ref: str,
                results: dict[str, RankResult]) -> dict[str, im.RankFacts]:
    """Every rank's build facts; a rank that cannot answer, or whose engine is down, fails in `results`."""
    facts: dict[str, im.RankFacts] = {}
    got = probe(cluster, chain, model, ref)
    for node, err in got.failed.items():
        results[node].fail(err)
    for node, f in got.ok.items():
        if not f.engine_ok:
            results[node].error = f"Docker engine not reachable: {f.engine}"
            results[node].fix = f"start the Docker engine on {node} (or fix DOCKER_HOST for its SSH sessions)"
        else:
            facts[node] = f
    return facts


# ------------------------------------------------------------------------------------ a prebuilt image


def transport(ref: str, head_digest: str | None, ship: bool) -> tuple[str, str]:
    """How the ranks get a prebuilt image, and why: ("pull", ...) or ("ship", ...)."""
    if "@" in ref:
        return "pull", (f"IMAGE is pinned by digest: each rank pulls {ref} from its registry, in parallel; Docker "
                        "verifies the digest on every rank and no byte passes through the head or this machine "
                        "(a shipped copy would lose the digest, and `docker run` would pull it anyway)")
    if head_digest and not ship:
        return "pull", (f"the head resolved {ref} to {head_digest}: each rank pulls that digest from the registry, "
                        "in parallel (the tag may have moved since; the digest cannot), and tags it as IMAGE "
                        "(--ship sends the head's copy instead, for ranks without registry access)")
    return "ship", ("--ship: " if ship else f"{ref} has no registry digest on the head (loaded or built there): ") + \
        "the head sends each rank only the layers it lacks, one compressed stream per distinct need"


def prebuilt(settings: Any, ssh_config: Any, *, ship: bool, dry_run: bool, progress: ProgressFactory) -> Outcome:
    """`build` for a recipe that runs a published image: resolve IMAGE on the head (pulling it there when
    missing), then give every other rank that very image (by image ID): pulled by digest, or shipped."""
    recipe = settings.recipe
    nodes: list[str] = settings.nodes
    ref = settings.image
    results = {n: RankResult(n, i) for i, n in enumerate(nodes)}
    out: dict[str, Any] = {"recipe": recipe.name, "mode": "prebuilt", "dry_run": dry_run, "top": ref,
                           "source": recipe.prebuilt.source}
    with Cluster(nodes, ssh_config) as cluster, _locked(cluster, settings, "build", dry_run):
        facts = probe_facts(cluster, [], str(settings.model), ref, results)
        head = nodes[0]
        head_img = facts[head].image(ref) if head in facts else None
        if dry_run:
            p = base_identity.identify(ref, head_img) if head_img is not None else None
            how, why = transport(ref, p.digest if p else None, ship)
            out["transport"] = {"how": how, "why": why}
            plan: dict[str, Any] = {}
            for n in nodes:
                if not results[n].ok:
                    plan[n] = {"error": results[n].error}
                elif n == head:
                    plan[n] = {"image": f"has {p.describe()}" if p else f"pulls {ref}"}
                elif p is None:
                    plan[n] = {"image": f"{how}: the head's copy (known once the head has pulled it)"}
                elif (reason := base_identity.stale(p, facts[n].image(ref), "prebuilt")) is None:
                    plan[n] = {"image": "nothing: it has the head's image"}
                else:
                    plan[n] = {"image": f"{how}: {reason}"}
            out["plan"] = plan
            return Outcome(out, results, plan_only=True)
        board = progress(nodes, ["image"])
        with board:
            report = align_base(cluster, facts, results, ref, board, ship=ship, what="prebuilt")
        if report is not None:
            how, why = transport(ref, report.get("digest"), ship)
            out["image"] = report
            out["transport"] = {"how": how, "why": why}
            for n in nodes:
                img = facts[n].image(ref) if n in facts else None
                if results[n].ok and img is not None:
                    results[n].image_id = img.id
                    results[n].ship_note = results[n].ship_note or (
                        f"pulled {report['digest'] or ref}" if report["fixed_by"].get(n) == "pull" else "up to date")
            out["versions"] = _prebuilt_versions(cluster.node(head), ref) if results[head].ok else None
    return Outcome(out, results)


def _prebuilt_versions(node: Node, ref: str) -> dict[str, str] | str:
    """What the image reports (vllm, torch, exllamav3, NCCL): the same probe as a chain layer's, without
    the label (a label would make another image, no longer the published one)."""
    res = node.docker(im.versions_argv(ref), timeout=300)
    try:
        return im.parse_versions(res.stdout)
    except (ParseError, ValueError):
        return f"the version probe failed (exit {res.exit_code}): {res.stderr.strip()[-200:]}"


def _retain(cluster: Cluster, settings: Any, chain: list[im.LayerRef], results: dict[str, RankResult],
            out: dict[str, Any]) -> None:
    """Every rank that built (or was shipped) the chain: hash tags, the last BUILD_KEEP_CHAINS, no leftovers."""
    from ..remote.retention import DEFAULT_KEEP, retain

    keep = int(settings.get("BUILD_KEEP_CHAINS", DEFAULT_KEEP))
    tags = [layer.tag for layer in chain]
    done = cluster.run_all(lambda node: retain(node, keep, settings.recipe.name, tags),
                           nodes=[n for n in cluster.names if results[n].ok])
    for n, err in done.failed.items():
        results[n].fail(err)
    for n, removed in done.ok.items():
        if removed:
            out.setdefault("removed", {})[n] = removed



# ------------------------------------------------------------------------------------ the base, pinned


def align_base(cluster: Cluster, facts: dict[str, im.RankFacts], results: dict[str, RankResult], base_ref: str,
               board: Progress, *, ship: bool = False, what: str = "base") -> dict[str, Any] | None:
    """Resolve BASE_IMAGE on the head (pulling it there if needed) and give every other rank that very
    image: pulled by digest when the head has one, else sent from the head (layers it lacks only).
    Updates `facts` so the build sees the aligned base. A rank still different afterwards fails with
    the reason: one `build` fixes a stale base or says why it cannot, it never sends the user round."""
    head_name = cluster.names[0]
    if head_name not in facts or not results[head_name].ok:
        return None
    head = cluster.node(head_name)
    img = facts[head_name].image(base_ref)
    if img is None:
        board.note(head_name, f"pulling {what} {base_ref}")
        res = head.docker(["pull", base_ref], timeout=PULL_TIMEOUT)
        got = inspect_images(head, [base_ref]) if res.ok else []
        if not got:
            tail = _error_tail(res.stderr.splitlines() or res.stdout.splitlines()) or f"exit {res.exit_code}"
            results[head_name].error = f"{what} image {base_ref} is not on the head and cannot be pulled: {tail}"
            results[head_name].fix = f"load or pull {base_ref} on {head_name}, or set {'BASE_IMAGE' if what == 'base' else 'IMAGE'}"
            return None
        img = got[0]
        _replace_image(facts, head_name, base_ref, img)
    pin = base_identity.identify(base_ref, img)
    stale = {n: reason for n in cluster.names[1:] if n in facts and results[n].ok
             if (reason := base_identity.stale(pin, facts[n].image(base_ref), what))}
    report: dict[str, Any] = {**pin.as_dict(), "stale": dict(stale), "fixed_by": {}}
    if not stale:
        return report
    by_digest = "@" in base_ref  # `docker run repo@sha256:` on a rank that only loaded it would pull it anyway
    if ship and by_digest:
        for n in stale:
            results[n].error = (f"{base_ref} is pinned by digest, and a shipped copy carries no digest "
                                "(`docker load` drops RepoDigests), so the rank would pull it at `up`")
            results[n].fix = f"let {n} pull it (run `sparkctl build` without --ship), or pin IMAGE by tag"
        return report
    if pin.digest and not ship:
        digest = pin.digest

        def pull(node: Node) -> None:
            board.note(node.name, f"pulling {digest}")
            if node.docker(["pull", digest], timeout=PULL_TIMEOUT).ok and not by_digest:
                node.docker(["tag", digest, base_ref], timeout=60)

        cluster.run_all(pull, nodes=list(stale))
        for n in stale:
            report["fixed_by"][n] = "pull"
    for n in stale:
        got = inspect_images(cluster.node(n), [base_ref])
        _replace_image(facts, n, base_ref, got[0] if got else None)
    still = [n for n in stale if base_identity.stale(pin, facts[n].image(base_ref), what)]
    if still and not by_digest:  # no digest (a base built or loaded locally), or the pull did not give the head's image
        ship_images(cluster, [base_ref], facts, results, board, still)
        for n in still:
            report["fixed_by"][n] = "ship"
            got = inspect_images(cluster.node(n), [base_ref])
            _replace_image(facts, n, base_ref, got[0] if got else None)
    for n in stale:
        left = base_identity.stale(pin, facts[n].image(base_ref), what)
        if left and results[n].ok:
            results[n].error = f"{left}, and neither pulling {pin.describe()} nor sending the head's {what} fixed it"
            results[n].fix = f"check the Docker engine and disk space on {n}"
        elif not left:
            board.note(n, f"{what} = head's {pin.describe()}")
    return report


def _replace_image(facts: dict[str, im.RankFacts], node: str, ref: str, image: Image | None) -> None:
    """`facts[node]` with `ref` now naming `image` (the tag left whatever image had it before)."""
    tag = normalize_image_ref(ref)
    kept = tuple(i for i in facts[node].images if tag not in i.repo_tags and ref not in i.repo_digests)
    facts[node] = replace(facts[node], images=kept + ((image,) if image else ()))


# ------------------------------------------------------------------------------------ shipping


def ship_chain(cluster: Cluster, chain: Sequence[im.LayerRef], facts: dict[str, im.RankFacts],
               results: dict[str, RankResult], board: Progress) -> dict[str, Any]:
    targets = [n for n in cluster.names[1:] if results[n].ok and n in facts]
    return ship_images(cluster, [layer.tag for layer in chain], facts, results, board, targets)


def ship_images(cluster: Cluster, tags: list[str], facts: dict[str, im.RankFacts], results: dict[str, RankResult],
                board: Progress, targets: list[str]) -> dict[str, Any]:
    """Send `targets` the head's images for `tags`, only the layers each lacks (the chain, or the base)."""
    head_name = cluster.names[0]
    head = cluster.node(head_name)
    head_images = {img_tag: img for img in inspect_images(head, tags) for img_tag in img.repo_tags if img_tag in tags}
    if len(head_images) != len(tags):
        raise CheckFailed(f"{head_name}: {', '.join(t for t in tags if t not in head_images)} not on the head",
                          fix="run `sparkctl build --ship` again")
    top = head_images[tags[-1]]
    # A rank whose every chain tag already has the head's image ID needs nothing: not even a save.
    need = [n for n in targets if any((facts[n].image(t) or _NONE).id != head_images[t].id for t in tags)]
    for n in targets:
        if n not in need:
            results[n].ship_note = "up to date"
            board.note(n, "up to date: 0 bytes")
    report: dict[str, Any] = {"codec": None, "bytes_sent": 0, "streams": 0}
    if not need:
        return report
    needed = set().union(*(im.missing_layers(head_images, facts[n].images, tags) for n in need))
    res = head.run(im.save_argv(tags, needed, probe_script("save_filter.py").decode()), timeout=PULL_TIMEOUT)
    if not res.ok:
        raise CheckFailed(f"{head_name}: docker save failed: {res.stderr.strip()[-400:]}",
                          fix=f"check disk space in {head_name}'s TMPDIR (default /var/tmp)")
    report["save"] = im.parse_save_stats(res.stderr)
    try:
        saved, manifest = im.parse_saved(res.stdout)
    except ParseError as exc:
        raise CheckFailed(f"{head_name}: docker save's output cannot be read: {exc}",
                          fix=f"check `docker save` on {head_name}, then run `sparkctl build --ship` again") from None
    try:
        groups: dict[str, tuple[im.Selection, list[str]]] = {}
        for n in need:
            sel = im.select_for_rank(manifest, head_images, facts[n].images, tags)
            groups.setdefault(sel.key(), (sel, []))[1].append(n)
        codec = im.pick_codec(facts[head_name].tools, [facts[n].tools for n in need])
        report["codec"] = codec
        report["streams"] = len(groups)

        parallel([functools.partial(fan_out, cluster, head, sel, ranks, saved, codec, results, board)
                  for sel, ranks in groups.values()])
    finally:
        head.run(im.cleanup_argv(saved), timeout=120)
    report["bytes_sent"] = sum(results[n].shipped_bytes for n in need)
    report["top_id"] = top.id
    return report


class _NoImage:
    id = ""


_NONE = _NoImage()


def fan_out(cluster: Cluster, head: Node, sel: im.Selection, ranks: list[str], saved: str, codec: str,
            results: dict[str, RankResult], board: Progress) -> None:
    """One compressed stream from the head, copied to every rank's `docker load` at once."""
    import json

    manifest = json.dumps(sel.entries).encode()
    for n in ranks:
        board.note(n, f"shipping {len(sel.layers)} layer(s) ({codec})")
    sinks: dict[str, Stream] = {}
    outputs: dict[str, bytearray] = {n: bytearray() for n in ranks}
    for n in ranks:
        try:
            sinks[n] = cluster.node(n).open_stream(im.load_argv(codec), merge_stderr=True, timeout=60)
        except Exception as exc:
            results[n].fail(exc)
    src = head.open_stream(im.pack_argv(saved, codec, sel.members), timeout=60)
    err = bytearray()
    start = time.monotonic()
    try:
        src.write(manifest)
        src.close_input()
        last = time.monotonic()
        while sinks:
            data, more_err = src.read(1.0, limit=CHUNK)
            err += more_err
            if data:
                last = time.monotonic()
                for n, sink in list(sinks.items()):
                    try:
                        sink.write(data)
                        results[n].shipped_bytes += len(data)
                        outputs[n] += sink.read()[0]
                    except StreamLost as exc:
                        results[n].error = f"ship stream broke: {exc.cause}: {outputs[n].decode(errors='replace')[-300:]}"
                        del sinks[n]
            elif src.ended:
                break
            elif time.monotonic() - last > STALL_TIMEOUT:
                raise NodeError(head.name, "command-timeout", f"the ship stream stalled for {STALL_TIMEOUT:g}s")
        code = src.exit_status()
        if code != 0:
            raise NodeError(head.name, "docker", f"packing the layers failed (exit {code}): {err.decode(errors='replace')[-400:]}")
        # EOF to every rank first: each `docker load` finishes only after its end of the stream, so
        # closing one rank's input after the previous rank's load ended made the loads run in turn.
        for sink in sinks.values():
            sink.close_input()
        for n, sink in sinks.items():
            status = _wait_exit(sink, outputs[n], 600.0)
            text = outputs[n].decode("utf-8", errors="replace").strip()
            if status != 0:
                results[n].error = f"docker load failed (exit {status}): {text[-400:]}"
                results[n].fix = f"check the Docker engine and disk space on {n}"
            else:
                results[n].shipped_layers = len(sel.layers)
                secs = time.monotonic() - start
                results[n].ship_note = f"{len(sel.layers)} layer(s), {results[n].shipped_bytes} bytes ({codec}) in {secs:.1f}s"
                board.note(n, "shipped " + results[n].ship_note)
    except Exception as exc:
        for n in ranks:
            if results[n].ok:
                results[n].fail(exc)
    finally:
        src.close()
        for sink in sinks.values():
            sink.close()


def _wait_exit(stream: Stream, sink: bytearray, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while not stream.exited:
        if time.monotonic() > deadline:
            return -1
        sink += stream.read(0.5)[0]
    return stream.exit_status()


# ------------------------------------------------------------------------------------ verify + report


def verify(cluster: Cluster, chain: Sequence[im.LayerRef], results: dict[str, RankResult], ship: bool) -> None:
    """Read back every rank's top image; with --ship every rank must have the head's exact image ID."""
    top = chain[-1].tag
    live = [n for n in cluster.names if results[n].ok]
    found = cluster.run_all(lambda node: inspect_images(node, [top]), nodes=live)
    for n, err in found.failed.items():
        results[n].fail(err)
    for n, imgs in found.ok.items():
        if not imgs:
            if results[n].layers and all(r.action in ("keep", "stale") for r in results[n].layers.values()):
                continue
            results[n].error = f"{top} is not on the node after the build"
        else:
            results[n].image_id = imgs[0].id
    if ship:
        head = results[cluster.names[0]]
        for n in cluster.names[1:]:
            r = results[n]
            if r.ok and head.image_id and r.image_id != head.image_id:
                r.error = f"image ID {r.image_id} differs from the head's {head.image_id}"
                r.fix = "run `sparkctl build --ship` again"


def _plan(refs: Sequence[im.LayerRef], chains: dict[str, list[im.LayerSpec]], facts: dict[str, im.RankFacts], results: dict[str, RankResult],
          builders: list[str], base_ref: str, only: str | None, no_cache: bool, ship: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    top_tag = refs[-1].tag
    for n, r in results.items():
        if not r.ok:
            plan[n] = {"error": r.error}
            continue
        if n in builders:
            steps = im.plan_build(chains[n], facts[n], base_ref, only=only, no_cache=no_cache)
            plan[n] = {"steps": [vars(s) for s in steps]}
            continue
        head_steps = plan[builders[0]].get("steps", [])
        head_builds = any(s["action"] == "build" for s in head_steps)
        head_top = facts[builders[0]].image(top_tag) if builders[0] in facts else None
        mine = facts[n].image(top_tag)
        if head_builds or head_top is None:
            plan[n] = {"ship": "the layers it lacks of the head's new image (known after the head builds)"}
        elif mine is not None and mine.id == head_top.id:
            plan[n] = {"ship": "nothing: it has the head's image"}
        else:
            held = im.held_chain_ids(facts[n].images)
            lack = sum(1 for cid in im.chain_ids(head_top.layers) if cid not in held)
            plan[n] = {"ship": f"{lack} of {len(head_top.layers)} layers of the head's {top_tag}"}
    return plan
