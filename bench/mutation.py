#!/usr/bin/env python3
"""Mutation testing of the safety-critical modules: cosmic-ray breaks each line on purpose,
the tests that exercise the module run against every break, and a break that no test notices (a
surviving mutant) is printed with its diff.

    .venv/bin/pip install -e '.[mutation]'                  # cosmic-ray, into the project's venv
    .venv/bin/python bench/mutation.py --list               # the modules and the tests each one runs
    .venv/bin/python bench/mutation.py systemd_unit lock    # score per module, and the survivors
    .venv/bin/python bench/mutation.py plan --tests 'tests/unit/spec/test_planner.py -k dcp'  # a narrower selection
    .venv/bin/python bench/mutation.py cleanup --confirm    # survivors re-run against the whole unit suite
    .venv/bin/python bench/mutation.py fabric --lab         # ... and against the module's lab subset (root)
    nice -n 19 .venv/bin/python bench/mutation.py lock --budget 30   # 30 minutes of it; run again to go on
    .venv/bin/python bench/mutation.py lock --recheck       # the last session's survivors, against the tests now
    .venv/bin/python bench/mutation.py systemd_unit --check-floors  # exit 1 below the module's floor

Not run by CI: each mutant is one pytest run (2-30 s here), and a module has 50 to 2,000 mutants. Run a
module at a time; a session is kept under --work (default .mutation/, ignored by git) and resumed when
the same module is asked again with the same tests (same code, same test files), so an interrupted run
goes on where it stopped (--fresh starts over).

cosmic-ray runs the pending mutants in a random order (its WorkDB asks SQLite for them so), so a run
stopped by --budget has judged a fair sample: its score estimates the module's, and the report says
how many are still to run. A mutant that lies wholly inside an annotation of a file that has `from
__future__ import annotations` (and no get_type_hints/pydantic/typer) is skipped before the run: such
an annotation is never evaluated, so the mutant is equivalent by construction (`str | None` -> `str &
None` was the commonest survivor: 11 to 143 of a module's mutants).

--check-floors is the shape for a gate: each module that has been run to its end has a floor (its
score after its survivors were killed or explained), and the run exits 1 when a module scores below
it or has mutants still to run. It is not a CI step: the whole list is hours to days of CPU here
(docs/mutations.md has the measured rates), and CI's budget is 60 minutes.

How it works: for each module, the selected tests first run once on the unchanged code (the baseline:
it must pass, and its time sets the per-mutant timeout, 3x + 30 s); then `cosmic-ray init` lists the
mutants, `cr-filter-pragma` skips lines marked `# pragma: no mutate`, `cr-filter-operators` skips the
operators named by --exclude-operator, and `cosmic-ray exec` applies each mutant to the file IN PLACE
(the working tree's file: the editable install imports it, and so do the probes and scripts the tests
run in subprocesses), runs the tests, and restores the file. This script also keeps each module's bytes
and puts them back if anything differs afterwards, even on Ctrl-C; it refuses to start on a module with
uncommitted changes, so `git diff` shows any damage.

Score = killed / (killed + survived); a timeout counts as killed (the break hung the tests), a mutant
the tests could not run ("incompetent": the test command itself failed to start) and a skipped one are
counted apart. --confirm re-runs each survivor against the whole unit suite (`-m "not lab and not
fidelity"`, about 6 min a mutant here), --lab against the module's named lab subset: a survivor that
either kills is reported as killed there, and the rest are the ones to kill with a new test or to list
in docs/mutations.md as equivalent (with why).

Why cosmic-ray and not mutmut: mutmut 3 mutates a copy of the sources under mutants/ and puts only
mutants/, mutants/src and mutants/source on sys.path; this repository's package lives in launcher/
and is installed editable, so the tests kept importing the original code (tried on systemd_unit.py:
"could not find any test case for any mutant"), and the node-side probes that tests run as files in
subprocesses would not see its trampolines either. cosmic-ray mutates the real file, one at a time.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "launcher/sparkctl"
UNIT_MARK = "not lab and not fidelity"


@dataclass(frozen=True)
class Module:
    paths: tuple[str, ...]  # files (or folders) under the repository root
    tests: tuple[str, ...]  # the unit tests that exercise it: the fast pass's selection
    lab: tuple[str, ...] = ()  # the lab tests that exercise it, for --lab
    note: str = ""
    floor: float | None = None  # --check-floors: the least score (percent) this module keeps; None: not yet measured


# The safety-critical modules and the tests that exercise each one.
MODULES: dict[str, Module] = {
    "cluster": Module((f"{PKG}/cluster",),
                      ("tests/unit/test_cluster_rules.py", "tests/unit/test_cluster.py", "tests/unit/test_hostkeys.py",
                       "tests/unit/test_fanout.py", "tests/unit/test_hostile_values.py", "tests/unit/test_ssh_setups.py"),
                      ("tests/lab/test_connections_lab.py", "tests/lab/test_hostile_lab.py"),
                      "the SSH layer: ssh -G, host keys, the transport, the channel"),
    "hostkeys": Module((f"{PKG}/cluster/hostkeys.py",),
                       ("tests/unit/test_hostkeys.py", "tests/unit/test_cluster.py", "tests/unit/test_ssh_setups.py",
                        "-k", "hostkeys or host_key or hashed or trust or hop or aliases_of_one or cert or revoked"),
                       ("tests/lab/test_connections_lab.py",), "host-key verdicts alone (part of cluster)"),
    "sshconfig": Module((f"{PKG}/cluster/sshconfig.py",),
                        ("tests/unit/test_hostkeys.py", "tests/unit/test_cluster.py", "tests/unit/test_ssh_setups.py"),
                        ("tests/lab/test_connections_lab.py",), "ssh -G, Host patterns, Include (part of cluster)"),
    # The fast files first: with -x a killed mutant stops at the first red test.
    "cleanup": Module((f"{PKG}/remote/cleanup.py",),
                      ("tests/unit/remote/test_cleanup.py", "tests/unit/test_crash_safety.py",
                       "tests/unit/test_status_orphans.py", "tests/unit/test_safety_offline.py"),
                      ("tests/lab/test_foreign_lab.py", "tests/lab/test_lifecycle_lab.py")),
    "service": Module((f"{PKG}/remote/service.py",),
                      ("tests/unit/remote/test_service_rules.py", "tests/unit/test_memory_wait.py",
                       "tests/unit/test_drop_caches.py", "tests/unit/test_lifecycle_units.py",
                       "tests/unit/test_crash_safety.py", "tests/unit/test_lifecycle_paths.py",
                       "tests/unit/test_safety_offline.py"),
                      ("tests/lab/test_lifecycle_lab.py", "tests/lab/test_secrets_lab.py")),
    "lock": Module((f"{PKG}/remote/lockdir.py",),
                   ("tests/unit/remote/test_lockdir.py", "tests/unit/test_lifecycle_units.py",
                    "tests/unit/test_crash_safety.py"),
                   ("tests/lab/test_lifecycle_lab.py",)),
    "signals": Module((f"{PKG}/signals.py",),
                      ("tests/unit/test_signals_states.py", "tests/unit/test_threads.py", "tests/unit/test_crash_safety.py"),
                      ("tests/lab/test_signals_lab.py",)),
    "builders": Module((f"{PKG}/spec/builders.py",),
                       ("tests/unit/spec/test_builders.py", "tests/unit/test_lifecycle_units.py",
                        "tests/unit/spec/test_renderer.py", "tests/unit/test_lab_vllm.py", "tests/unit/test_render_command.py",
                        "tests/unit/test_hostile_values.py", "tests/unit/spec/test_lws.py", "tests/unit/test_fabric.py"),
                       ("tests/lab/test_secrets_lab.py", "tests/lab/test_lifecycle_lab.py")),
    "plan": Module((f"{PKG}/spec/planner.py",),
                   ("tests/unit/spec/test_planner_kv_rules.py", "tests/unit/spec/test_planner_checkpoint_rules.py",
                    "tests/unit/spec/test_planner.py", "tests/unit/spec/test_renderer.py"),
                   (), "the KV plan; vLLM's own planner judges it in tests/fidelity (its own venv)"),
    "settings": Module((f"{PKG}/spec/settings.py",),
                       ("tests/unit/spec/test_settings_rules.py", "tests/unit/spec/test_settings.py", "tests/unit/spec/test_env_example.py",
                        "tests/unit/spec/test_vllm_flags.py", "tests/unit/spec/test_topology.py", "tests/unit/spec/test_renderer.py",
                        "tests/unit/test_hostile_values.py", "tests/unit/test_safety_offline.py"),
                       ("tests/lab/test_secrets_lab.py",), "redaction and strict keys"),
    "systemd_unit": Module((f"{PKG}/spec/systemd_unit.py",), ("tests/unit/test_watch.py",),
                           ("tests/lab/test_watch_lab.py",), floor=98.0),  # 49 of 50; the survivor equivalent
    "fabric": Module((f"{PKG}/orchestrate/fabric_test.py",), ("tests/unit/test_fabric_rules.py", "tests/unit/test_fabric.py",
                                                            "tests/unit/test_safety_offline.py"),
                     ("tests/lab/test_fabric_lab.py",), "the fabric test and its sweep"),
    "memory": Module((f"{PKG}/rules/memory.py",), ("tests/unit/rules/test_memory.py", "tests/unit/test_memory_wait.py"),
                     ("tests/lab/test_memory_lab.py",),
                     "what `up` may wait for or drop: foreign GPU processes, memory not back, DROP_CACHES",
                     floor=97.8),  # 133 of 136; 3 equivalent
    "nic_pins": Module((f"{PKG}/rules/nic_pins.py",),
                       ("tests/unit/rules/test_nic_pins_rules.py", "tests/unit/rules/test_nic_pins.py", "tests/unit/rules/test_check_rules.py"),
                       (), "the fabric discovery rule (netdev, RDMA device, GID index), for check and up",
                       floor=96.3),  # 130 of 135; 5 equivalent
    "probes": Module((f"{PKG}/probes/ckpt_scan.py", f"{PKG}/probes/hf_pull.py", f"{PKG}/probes/model_node.py",
                      f"{PKG}/probes/save_filter.py"),
                     ("tests/unit/test_probes_rules.py", "tests/unit/spec/test_resources.py", "tests/unit/test_model_transfer.py",
                      "tests/unit/checkpoint/test_verify_summary.py", "tests/unit/checkpoint/test_verify.py", "tests/unit/image/test_chain.py"),
                     ("tests/lab/test_verify_lab.py", "tests/lab/test_model_lab.py"),
                     "the node-side probes' argument handling (they run as files, on argv and stdin)"),
}


def _files(module: Module) -> list[Path]:
    out: list[Path] = []
    for p in module.paths:
        path = ROOT / p
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def _bin(name: str) -> str:
    found = Path(sys.executable).parent / name
    if found.exists():
        return str(found)
    which = shutil.which(name)
    if not which:
        sys.exit(f"mutation.py: {name} not found: install the extra, `.venv/bin/pip install -e '.[mutation]'`")
    return which


def pytest_command(tests: list[str], marker: str = UNIT_MARK, *, first_failure: bool = True) -> str:
    words = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker]
    words += ["-x"] if first_failure else []
    return shlex.join(words + tests)


@dataclass
class Result:
    module: str
    mutants: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    survivors: list[dict[str, object]] = field(default_factory=list)
    baseline_s: float = 0.0
    seconds: float = 0.0
    error: str = ""

    @property
    def score(self) -> float | None:
        judged = self.outcomes["killed"] + self.outcomes["survived"]
        return self.outcomes["killed"] / judged if judged else None


def _dirty(files: list[Path]) -> list[str]:
    r = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *map(str, files)],
                       capture_output=True, text=True, check=False)
    return [ln for ln in r.stdout.splitlines() if ln.strip()]


def _session_key(module: Module, tests: list[str], excluded: list[str]) -> str:
    """Same module code, same tests (their files' content too), same filters: the same session, resumed."""
    test_files = [ROOT / t.split("::")[0] for t in tests if (ROOT / t.split("::")[0]).is_file()]
    digests = [hashlib.sha256(f.read_bytes()).hexdigest() for f in [*_files(module), *test_files]]
    text = json.dumps([module.paths, tests, excluded, digests])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _config(path: Path, module: Module, command: str, timeout: float, excluded: list[str]) -> None:
    q = json.dumps  # TOML basic strings are JSON strings for what we write here
    lines = ["[cosmic-ray]",
             f"module-path = [{', '.join(q(p) for p in module.paths)}]",
             f"timeout = {timeout:.0f}",
             "excluded-modules = []",
             f"test-command = {q(command)}",
             "",
             "[cosmic-ray.distributor]",
             'name = "local"',
             "",
             "[cosmic-ray.filters.operators-filter]",
             f"exclude-operators = [{', '.join(q(e) for e in excluded)}]",
             ""]
    path.write_text("\n".join(lines))


def _annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (line, column) spans of the file's annotations, if Python never evaluates them.

    Under `from __future__ import annotations` an annotation is a string nobody reads at run time
    (unless something calls get_type_hints: a file that names it, pydantic or typer is left alone), so
    a mutant inside one (`str | None` -> `str & None`, the commonest of cosmic-ray's) is equivalent by
    construction. Columns are characters, as cosmic-ray's (parso's) positions are; ast's are bytes."""
    text = path.read_text()
    if "from __future__ import annotations" not in text or re.search(r"get_type_hints|pydantic|typer", text):
        return []
    lines = text.splitlines()

    def pos(line: int, col: int) -> tuple[int, int]:
        return line, len(lines[line - 1].encode()[:col].decode(errors="ignore"))

    spans = []
    for node in ast.walk(ast.parse(text)):
        notes: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            notes = [node.annotation]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes = [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        for n in notes:
            if n is not None and n.end_lineno is not None and n.end_col_offset is not None:
                spans.append((pos(n.lineno, n.col_offset), pos(n.end_lineno, n.end_col_offset)))
    return spans


def _skip_annotations(session: Path) -> int:
    """Mark every mutant that lies wholly inside an unevaluated annotation as skipped; how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans: dict[Path, list[tuple[tuple[int, int], tuple[int, int]]]] = {}
    skipped = 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            inside = True
            for m in item.mutations:
                path = Path(m.module_path).resolve()
                if path not in spans:
                    spans[path] = _annotation_spans(path)
                start, end = tuple(m.start_pos), tuple(m.end_pos)
                inside = inside and any(a <= start and end <= b for a, b in spans[path])
            if inside and item.mutations:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="annotation"))
                skipped += 1
    return skipped


def _changed_lines(diff: str) -> tuple[int | None, str]:
    """The module's line number of the first changed line, and the diff's -/+ lines."""
    line, first = None, None
    for ln in diff.splitlines():
        if m := re.match(r"@@ -(\d+)", ln):
            line = int(m.group(1)) if line is None else line
        elif line is not None and first is None:
            if ln.startswith("-"):
                first = line
            elif ln.startswith(" "):
                line += 1
    body = [ln for ln in diff.splitlines() if ln[:1] in "-+" and not ln.startswith(("---", "+++"))]
    return first, "\n".join(body)


def _read_session(session: Path, result: Result) -> None:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        result.mutants = db.num_work_items
        for item, res in db.completed_work_items:
            if res.worker_outcome == "skipped":
                result.outcomes["skipped"] += 1
                result.outcomes["in annotations"] += res.output == "annotation"
                continue
            if res.worker_outcome in ("exception", "abnormal"):
                result.outcomes["incompetent"] += 1
                continue
            outcome = str(res.test_outcome.value if res.test_outcome else "incompetent")
            if outcome == "killed" and (res.output or "").strip() == "timeout":
                result.outcomes["timeout"] += 1
            result.outcomes[outcome] += 1
            if outcome == "survived":
                m = item.mutations[0]
                line, change = _changed_lines(res.diff or "")
                result.survivors.append({"file": str(Path(m.module_path).resolve().relative_to(ROOT)), "line": line,
                                         "operator": m.operator_name, "occurrence": m.occurrence, "change": change})
        result.outcomes["pending"] = sum(1 for _ in db.pending_work_items)


def _restore(backup: dict[Path, bytes]) -> list[str]:
    restored = []
    for path, data in backup.items():
        if path.read_bytes() != data:
            path.write_bytes(data)
            restored.append(str(path.relative_to(ROOT)))
    return restored


def run_module(name: str, module: Module, args: argparse.Namespace) -> Result:
    result = Result(name)
    files = _files(module)
    tests = args.tests or list(module.tests)
    if dirty := _dirty(files):
        result.error = f"uncommitted changes in {', '.join(dirty)}: commit or stash them first (the tool edits in place)"
        return result
    backup = {f: f.read_bytes() for f in files}
    work = Path(args.work).resolve() / name
    work.mkdir(parents=True, exist_ok=True)
    if args.recheck:
        return _recheck(result, work, tests, backup)
    key = _session_key(module, tests, args.exclude_operator)
    cfg, session = work / f"{key}.toml", work / f"{key}.sqlite"
    if args.fresh:
        session.unlink(missing_ok=True)
    start = time.monotonic()
    try:
        t0 = time.monotonic()
        base = subprocess.run(shlex.split(pytest_command(tests)), cwd=ROOT, capture_output=True, text=True,
                              check=False)
        result.baseline_s = time.monotonic() - t0
        if base.returncode != 0:
            result.error = "the baseline (no mutation) is red: " + (base.stdout.strip().splitlines() or ["?"])[-1]
            return result
        _config(cfg, module, pytest_command(tests), 3 * result.baseline_s + 30, args.exclude_operator)
        if not session.exists():
            cr = _bin("cosmic-ray")
            subprocess.run([cr, "init", str(cfg), str(session)], cwd=ROOT, check=True)
            subprocess.run([_bin("cr-filter-pragma"), str(session)], cwd=ROOT, check=True)
            if args.exclude_operator:
                subprocess.run([_bin("cr-filter-operators"), str(session), str(cfg)], cwd=ROOT, check=True)
            say(f"{name}: {_skip_annotations(session)} mutants inside annotations skipped (never evaluated)")
        say(f"{name}: baseline {result.baseline_s:.1f} s over {' '.join(tests)}; running the mutants "
            f"(session {session.relative_to(ROOT) if session.is_relative_to(ROOT) else session})")
        _exec(cfg, session, args.budget * 60 - (time.monotonic() - start) if args.budget else None, name)
        _read_session(session, result)
        if commands := _confirm_commands(module, args, name):
            _confirm(result, commands, backup)
    finally:
        if restored := _restore(backup):
            say(f"{name}: restored {', '.join(restored)} byte-exact (a mutant was left applied)")
        result.seconds = time.monotonic() - start
    return result


def _recheck(result: Result, work: Path, tests: list[str], backup: dict[Path, bytes]) -> Result:
    """The survivors of the module's latest session, each run again against the module's tests as they
    are now (after new tests were written for them): the score after, without running every mutant again.
    The mutants killed before stay killed (tests were only added), and the report says which session."""
    sessions = sorted(work.glob("*.sqlite"), key=lambda p: p.stat().st_mtime)
    if not sessions:
        result.error = "no session to recheck: run the module first"
        return result
    start = time.monotonic()
    try:
        _read_session(sessions[-1], result)
        say(f"{result.module}: rechecking {len(result.survivors)} survivors of {sessions[-1].name} "
            f"against {' '.join(tests)}")
        _confirm(result, [("new tests", pytest_command(tests))], backup)
    finally:
        if restored := _restore(backup):
            say(f"{result.module}: restored {', '.join(restored)} byte-exact (a mutant was left applied)")
        result.seconds = time.monotonic() - start
    return result


def _exec(cfg: Path, session: Path, budget_s: float | None, name: str) -> None:
    """cosmic-ray exec, stopped (with every test it started) once budget_s has passed: the session keeps
    what ran, and the same command goes on from there."""
    proc = subprocess.Popen([_bin("cosmic-ray"), "exec", str(cfg), str(session)], cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(budget_s, 1.0) if budget_s is not None else None)
    except subprocess.TimeoutExpired:
        say(f"{name}: --budget spent; stopping (the session keeps what ran)")
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        return
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        raise
    if rc < 0:  # cosmic-ray was stopped by a signal from outside: as an interruption
        raise KeyboardInterrupt
    if rc != 0:
        raise subprocess.CalledProcessError(rc, "cosmic-ray exec")


def _confirm_commands(module: Module, args: argparse.Namespace, name: str) -> list[tuple[str, str]]:
    commands = []
    if args.confirm:
        commands.append(("unit suite", pytest_command(["tests"])))
    if args.lab:
        if not module.lab:
            say(f"{name}: no lab subset named for it")
        else:
            commands.append(("lab: " + " ".join(module.lab), pytest_command(list(module.lab), "lab")))
    return commands


def _confirm(result: Result, commands: list[tuple[str, str]], backup: dict[Path, bytes],
             timeout: float = 1800) -> None:
    """Run each survivor again under each (label, command); one that any command kills is counted
    killed, with what killed it."""
    still = []
    for s in result.survivors:
        for label, command in commands:
            try:
                r = subprocess.run([_bin("cosmic-ray"), "mutate-and-test", str(ROOT / str(s["file"])),
                                    str(s["operator"]), str(s["occurrence"]), command], cwd=ROOT,
                                   capture_output=True, text=True, check=False, timeout=timeout)
                outcome = json.loads(r.stdout).get("test_outcome")
            except subprocess.TimeoutExpired:
                outcome = "killed"  # as cosmic-ray counts a timeout
            except ValueError:
                outcome = None
            finally:
                _restore(backup)
            if outcome == "killed":
                s["killed_by"] = label
                break
        if "killed_by" in s:
            result.outcomes["survived"] -= 1
            result.outcomes["killed"] += 1
            result.outcomes["killed by " + str(s["killed_by"]).split(":")[0]] += 1
        else:
            still.append(s)
    result.survivors = still


def say(text: str) -> None:
    print(f"==> {text}", file=sys.stderr, flush=True)


def report(results: list[Result]) -> None:
    print(f"\n{'module':<14} {'mutants':>7} {'killed':>6} {'survived':>8} {'timeout':>7} {'incomp.':>7} "
          f"{'skipped':>7} {'score':>6}  time")
    for r in results:
        if r.error:
            print(f"{r.module:<14} error: {r.error}")
            continue
        o = r.outcomes
        score = f"{100 * r.score:.1f}%" if r.score is not None else "-"
        pending = f" ({o['pending']} not run yet: run again to go on)" if o["pending"] else ""
        print(f"{r.module:<14} {r.mutants:>7} {o['killed']:>6} {o['survived']:>8} {o['timeout']:>7} "
              f"{o['incompetent']:>7} {o['skipped']:>7} {score:>6}  {r.seconds:.0f} s{pending}")
    for r in results:
        if r.survivors:
            print(f"\nsurviving mutants of {r.module} ({len(r.survivors)}):")
            for s in r.survivors:
                print(f"  {s['file']}:{s['line']}  {s['operator']} #{s['occurrence']}")
                for ln in str(s["change"]).splitlines():
                    print(f"      {ln.strip()[:150]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("modules", nargs="*", help="modules to mutate (see --list); 'all' for every one (hours)")
    p.add_argument("--list", action="store_true", help="list the modules, their files and tests")
    p.add_argument("--tests", type=shlex.split, metavar="ARGS",
                   help="pytest arguments instead of the module's own selection, one quoted string\n"
                        "(paths, node ids, -k EXPR): --tests 'tests/unit/spec/test_planner.py -k dcp'")
    p.add_argument("--exclude-operator", action="append", default=[], metavar="REGEX",
                   help="skip cosmic-ray operators matching REGEX (e.g. 'core/NumberReplacer')")
    p.add_argument("--confirm", action="store_true", help="re-run survivors against the whole unit suite")
    p.add_argument("--lab", action="store_true", help="re-run survivors against the module's lab subset (root)")
    p.add_argument("--work", default=str(ROOT / ".mutation"), help="where sessions are kept (default .mutation/)")
    p.add_argument("--fresh", action="store_true", help="start the module's session over")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--recheck", action="store_true",
                   help="run only the survivors of the module's latest session again, against its tests now\n"
                        "(after new tests were written for them): the score after, in minutes, not hours")
    p.add_argument("--budget", type=float, metavar="MINUTES",
                   help="stop each module's run after MINUTES (the session keeps what ran; run again to go on)")
    p.add_argument("--check-floors", action="store_true",
                   help="exit 1 if a module scores below its floor (MODULES[...].floor) or has mutants not run")
    args = p.parse_args(argv)
    if args.list or not args.modules:
        for name, m in MODULES.items():
            n = len(_files(m))
            print(f"{name:<13} {' '.join(m.paths)} ({n} file{'s' if n > 1 else ''}){'  — ' + m.note if m.note else ''}")
            print(f"{'':<13} unit: {' '.join(Path(t).name for t in m.tests)}")
            if m.lab:
                print(f"{'':<13} lab:  {' '.join(Path(t).name for t in m.lab)}")
        return 0 if args.list else 2
    names = list(MODULES) if args.modules == ["all"] else args.modules
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        p.error(f"unknown module(s) {', '.join(unknown)}: one of {', '.join(MODULES)}")
    os.chdir(ROOT)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # `kill PID` stops it as Ctrl-C does: the module's file restored
    signal.signal(signal.SIGINT, stop)  # also when started in the background (`&` ignores SIGINT)
    results = []
    try:
        for name in names:
            results.append(run_module(name, MODULES[name], args))
    except KeyboardInterrupt:
        say("interrupted: the session keeps what ran; run the same command again to go on")
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps([{"module": r.module, "mutants": r.mutants, "outcomes": dict(r.outcomes),
                                                "score": r.score, "survivors": r.survivors, "error": r.error,
                                                "baseline_s": r.baseline_s, "seconds": r.seconds} for r in results],
                                              indent=1))
    return 1 if any(r.error for r in results) or (args.check_floors and not floors_met(results)) else 0


def floors_met(results: list[Result]) -> bool:
    """Each module's score against its floor: a line per module, False if any is below, unfinished or has none."""
    ok = True
    print()
    for r in results:
        floor, score, pending = MODULES[r.module].floor, r.score, r.outcomes["pending"]
        if r.error:
            continue
        if floor is None:
            print(f"{r.module}: no floor set (MODULES['{r.module}'].floor): not judged")
            ok = False
        elif pending or score is None:
            print(f"{r.module}: {pending} mutants not run yet: the floor ({floor:.1f}%) is not judged until all are")
            ok = False
        elif round(100 * score, 1) < floor:  # the floor is the score as printed, to one decimal
            print(f"{r.module}: score {100 * score:.1f}% is BELOW its floor {floor:.1f}%: a test stopped "
                  f"killing mutants; the survivors above say which lines")
            ok = False
        else:
            print(f"{r.module}: score {100 * score:.1f}% >= floor {floor:.1f}%")
    return ok


if __name__ == "__main__":
    sys.exit(main())
