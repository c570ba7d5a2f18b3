"""The serving image's own vLLM judges every rank's `vllm serve` argv before any rank starts.

`check` (its `argv` row) and `up` (before it starts anything; `watch`'s restarts and `rollback` too,
since they come through `orchestrate.up.start_service`) hand every rank's rendered argv -- the argv `up`
starts, from `render.render_all` -- to `probes/argv_judge.py`, run on the head inside the serving image:

  docker run --rm --interactive --pull never --network none [--gpus ...] --mount MODEL,readonly
             --env ... --entrypoint python3 IMAGE - RANKS_JSON        (the script on stdin)

The script uses the image's own vLLM: `vllm serve`'s parser and ServeSubcommand.validate (an unknown
flag, a value outside a flag's choices), `create_engine_config` on the checkpoint's config.json (an
architecture it does not know), and on vLLM's CPU platform the CPU attention backend's head sizes. So
a base image whose vLLM moved refuses the start with vLLM's own words. What it cannot say is "not
judged" (a warning, never a failure): the image lacks an importable vLLM (the lab's stand-in engine),
the head lacks the image, the judge ran past ARGV_JUDGE_TIMEOUT_S, the container could not start.

A verdict is cached on this machine (~/.cache/sparkctl/argv-judge/) by the image's ID, the checkpoint's
config.json hash, the script and every argv: a second `check` or `up` of the same inputs costs one SSH
round. Secrets never travel: they are in the rank env files `up` writes, not in the argv, and the
judge's container gets the rank's environment less every secret.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..cluster import Node, NodeError
from ..facts.parsing import parse_json
from ..rules.findings import FAIL, OK, WARN, Finding
from ..spec.builders import LABEL_CLUSTER, LABEL_RECIPE, RankSpec
from ..spec.resources import probe_script
from ..spec.settings import Settings

CHECK = "argv"
SCRIPT = "argv_judge.py"
MARK = "@@sparkctl-argv "
LABEL_PURPOSE = "sparkctl.purpose"
PURPOSE = "argv-judge"
DEFAULT_TIMEOUT_S = 240.0  # importing torch + vLLM on a loaded head: 20-40 s measured; a hung one is not a verdict
OK_V, REFUSED, NOT_JUDGED = "ok", "refused", "not-judged"

# One round on the head: the image's ID and the hash of the checkpoint's config.json (the cache key).
_IDENTIFY = r'''id=$(docker image inspect --format '{{.Id}}' "$1" 2>&1) || { echo "@@noimage $id"; exit 0; }
echo "@@image $id"
if [ -r "$2/config.json" ]; then echo "@@config $(sha256sum < "$2/config.json" | cut -c1-64)"; else echo "@@config none"; fi'''


@dataclass(frozen=True)
class Verdict:
    rank: int
    node: str
    verdict: str  # ok | refused | not-judged
    stage: str = ""  # import | parse | config | attention | image | run | timeout | off
    words: str = ""  # vLLM's own words (refused), or why it was not judged
    vllm: str = ""  # the image's vLLM version, when the script got that far
    cached: bool = False


@dataclass
class Judgement:
    verdicts: list[Verdict]
    seconds: float = 0.0
    cached: bool = False

    @property
    def refused(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.verdict == REFUSED]

    @property
    def not_judged(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.verdict == NOT_JUDGED]


def timeout_s(settings: Settings) -> float:
    return float(settings.get("ARGV_JUDGE_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def container_name(cluster: str) -> str:
    """A name of its own for each judge run (a random suffix): a `check` and an `up` of one cluster judging
    at once neither collide on the name nor remove each other's container."""
    return f"sparkctl-{cluster}-argv-judge-{secrets.token_hex(6)}"


def judge_run_argv(settings: Settings, specs: Sequence[RankSpec], name: str) -> list[str]:
    """`docker run` of the judge on the head, its container called `name`: no network, the model (and its
    companions) read-only where the ranks see them, the GPUs the ranks get (vLLM picks its platform from
    them), the rank environment less secrets, the script on stdin and every rank's argv as one JSON word."""
    from ..spec.builders import container_options

    cluster = settings.cluster_name
    argv = ["docker", "run", "--rm", "--interactive", "--pull", "never", "--network", "none",
            "--name", name,
            "--label", f"{LABEL_CLUSTER}={cluster}",
            "--label", f"{LABEL_RECIPE}={settings.recipe.name}",
            "--label", f"{LABEL_PURPOSE}={PURPOSE}"]  # fmt: skip
    opts = container_options(settings)
    for i, word in enumerate(opts):  # only the mounts and the GPUs: the judge needs no host network or ulimits
        if word in ("--mount", "--gpus") and i + 1 < len(opts):
            argv += [word, opts[i + 1]]
    secret = set(settings.secrets())
    env = specs[0].env if specs else {}
    for key, value in sorted(env.items()):
        if key not in secret:
            argv += ["--env", f"{key}={value}"]
    ranks = [{"rank": i, "argv": s.vllm_argv} for i, s in enumerate(specs)]  # by position: replicas repeat ranks
    return [*argv, "--entrypoint", "python3", settings.image, "-", json.dumps(ranks, separators=(",", ":"))]


def parse_output(stdout: str) -> dict[int, dict[str, Any]]:
    """The script's `@@sparkctl-argv {json}` lines, by position in the specs (its "rank" field); a line that
    is not its JSON is ignored."""
    out: dict[int, dict[str, Any]] = {}
    for line in stdout.splitlines():
        if not line.startswith(MARK):
            continue
        try:
            doc = parse_json(line[len(MARK):])
            out[int(doc.get("rank", -1))] = doc
        except (ValueError, TypeError, AttributeError):  # ParseError is a ValueError
            continue
    return out


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparkctl" / "argv-judge"


def cache_key(image_id: str, config_sha: str, specs: Sequence[RankSpec]) -> str:
    doc = {"image": image_id, "config": config_sha, "script": hashlib.sha256(probe_script(SCRIPT)).hexdigest(),
           "ranks": [s.vllm_argv for s in specs]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _cache_read(key: str) -> dict[int, dict[str, Any]] | None:
    try:
        doc = json.loads((cache_dir() / f"{key}.json").read_text())
        return {int(r): v for r, v in doc["ranks"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _cache_write(key: str, ranks: dict[int, dict[str, Any]]) -> None:
    try:
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}"
        tmp.write_text(json.dumps({"ranks": {str(r): v for r, v in ranks.items()}}))
        tmp.replace(d / f"{key}.json")
    except OSError:
        pass  # a cache that cannot be written costs the next run its time, nothing else


def _identify(head: Node, settings: Settings) -> tuple[str | None, str, str]:
    """(image ID or None, config.json's sha256 or "none", why there is no image)."""
    r = head.run(["sh", "-c", _IDENTIFY, "sparkctl-argv-judge", settings.image, str(settings.model)])
    image, config, why = None, "none", ""
    for line in r.stdout.splitlines():
        if line.startswith("@@image "):
            image = line.split(" ", 1)[1].strip()
        elif line.startswith("@@config "):
            config = line.split(" ", 1)[1].strip()
        elif line.startswith("@@noimage"):
            why = line.split(" ", 1)[1].strip() if " " in line else ""
    if image is None and not why:
        # docker said nothing: the user is told that, or what the shell said, never this script's own marker lines
        said = "\n".join(ln for ln in (r.stderr or r.stdout).splitlines() if not ln.startswith("@@")).strip()
        why = said[-300:] or ("`docker image inspect` found no such image and said nothing more"
                              if "@@noimage" in r.stdout else f"the image lookup ended with exit {r.exit_code}")
    return image, config, why


def _remove(head: Node, name: str) -> None:
    """Remove this run's judge container (by the name this run gave it; nothing else)."""
    try:
        head.run(["docker", "rm", "-f", name], timeout=30)
    except NodeError:
        pass


def judge(head: Node, settings: Settings, specs: Sequence[RankSpec], *,
          say: Callable[[str], None] = lambda m: None) -> Judgement:
    """Every spec's argv judged by the image's vLLM on `head` (cached by image, config.json, script, argv).
    Never raises for what the judge could not say: those ranks are `not-judged`, with why."""
    start = time.monotonic()
    bound = timeout_s(settings)

    def every(verdict: str, stage: str, words: str) -> Judgement:
        return Judgement([Verdict(s.rank, s.node, verdict, stage, words) for s in specs], time.monotonic() - start)

    if not specs:
        return every(NOT_JUDGED, "off", "no rank to judge")
    if bound <= 0:
        return every(NOT_JUDGED, "off", "ARGV_JUDGE_TIMEOUT_S=0 turns the judge off")
    try:
        image_id, config_sha, why = _identify(head, settings)
    except NodeError as exc:
        return every(NOT_JUDGED, "run", f"{head.name}: {exc.reason}")
    if image_id is None:
        return every(NOT_JUDGED, "image", f"{head.name} has no image {settings.image} ({why})")
    key = cache_key(image_id, config_sha, specs)
    found = _cache_read(key)
    cached = found is not None and all(i in found for i in range(len(specs)))
    if not cached:
        say(f"argv: {settings.image}'s own vLLM judges {len(specs)} rank argv(s) on {head.name} "
            f"(bound {bound:g} s; cached afterwards)")
        name = container_name(settings.cluster_name)
        argv = judge_run_argv(settings, specs, name)
        try:
            r = head.run(argv, stdin=probe_script(SCRIPT), timeout=bound)
        except NodeError as exc:
            _remove(head, name)
            stage = "timeout" if exc.kind == "command-timeout" else "run"
            words = (f"the judge ran past ARGV_JUDGE_TIMEOUT_S={bound:g} s on {head.name}" if stage == "timeout"
                     else f"{head.name}: {exc.reason}")
            return every(NOT_JUDGED, stage, words)
        except BaseException:  # Ctrl-C or a signal while the judge runs: its container does not outlive `up`
            from .. import signals

            with signals.shielded(deliver=False):
                _remove(head, name)
            raise
        found = parse_output(r.stdout)
        if not all(i in found for i in range(len(specs))):
            tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
            return every(NOT_JUDGED, "run", f"the judge's container gave no verdict on {head.name}: {tail[-300:]}")
        _cache_write(key, found)
    verdicts = []
    for i, s in enumerate(specs):
        doc = found[i]  # type: ignore[index]
        verdicts.append(Verdict(s.rank, s.node, str(doc.get("verdict", NOT_JUDGED)), str(doc.get("stage", "")),
                                str(doc.get("words", "")), str(doc.get("vllm", "")), cached))
    return Judgement(verdicts, time.monotonic() - start, cached)


FIX = ("change the setting that renders it (VLLM_EXTRA_ARGS, the recipe's [vllm] extra_args, the knob), or "
       "serve with an image whose vLLM accepts it; `sparkctl render` shows the argv")


def findings(j: Judgement, settings: Settings) -> list[Finding]:
    """One finding per rank: ok, refused (fail: vLLM's words and the fix), not judged (warn: why)."""
    out = []
    for v in j.verdicts:
        where = f"{v.node} rank {v.rank}"
        version = f"vLLM {v.vllm}" if v.vllm else "the image's vLLM"
        if v.verdict == OK_V:
            out.append(Finding(v.node, CHECK, OK, f"ok ({version})",
                               f"{where}: {version} in {settings.image} accepts the argv"
                               + (" (cached)" if v.cached else "")))
        elif v.verdict == REFUSED:
            out.append(Finding(v.node, CHECK, FAIL, f"refused ({v.stage})",
                               f"{where}: {version} in {settings.image} refuses the argv ({v.stage}): {v.words}",
                               FIX))
        else:
            out.append(Finding(v.node, CHECK, WARN, "not judged",
                               f"{where}: argv not judged by the image's vLLM: {v.words}", _not_judged_fix(v)))
    return out


def _not_judged_fix(v: Verdict) -> str:
    if v.stage == "image":
        return "`sparkctl build` (or pull) the image on the head; `up` will judge it then"
    if v.stage == "import":
        return "nothing to do for the lab's stand-in engine; a real image needs vLLM importable by python3"
    if v.stage == "timeout":
        return "raise ARGV_JUDGE_TIMEOUT_S (0 turns the judge off), or look at the head's load"
    if v.stage == "off":
        return ""
    return "run `sparkctl check -v` again; the start is not refused for it"


def refusal(j: Judgement, settings: Settings) -> str | None:
    """up's words when the image's vLLM refused a rank's argv, else None."""
    bad = j.refused
    if not bad:
        return None
    lines = [f"{v.node} rank {v.rank} ({f'vLLM {v.vllm}' if v.vllm else 'vLLM'}, {v.stage}): {v.words}" for v in bad]
    return (f"up refused, nothing was started: {settings.image}'s own vLLM refuses the argv of "
            f"{len(bad)} rank(s)\n  " + "\n  ".join(lines))


def warnings(j: Judgement) -> list[str]:
    """The not-judged ranks, one line (they share a reason almost always)."""
    miss = j.not_judged
    if not miss or all(v.stage == "off" for v in miss):
        return []
    reasons = sorted({v.words.replace("[", r"\[") for v in miss})  # vLLM's lists are not rich markup
    return [f"argv not judged by the image's vLLM for rank(s) {', '.join(str(v.rank) for v in miss)}: "
            + "; ".join(reasons)]


def to_dict(j: Judgement) -> dict[str, Any]:
    return {"seconds": round(j.seconds, 3), "cached": j.cached, "ranks": [asdict(v) for v in j.verdicts]}
