"""`watch`, `history`, `rollback`, `exec`, `export systemd`: keeping the service serving.

`watch` is the supervisor (policy in sparkctl.supervisor; this module is its hands: one SSH
connection per node, Docker, the head's HTTP API). `rollback` and the supervisor's restarts go
through `orchestrate.up.start_service`, the same path as `up`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import signal
import sys
import time
from typing import Any

import click

from .. import service, signals, watchstate
from ..builders import container_name
from ..cli import Globals
from ..cluster import Cluster, NodeError
from ..completion import rank_numbers
from ..errors import CheckFailed, UsageError
from ..history import content_hash_on, pick, read_history, rollback_overrides
from ..lock import audit_line, audit_tail_argv, new_owner, whoami
from ..orchestrate import require_all
from ..orchestrate.locking import lock_cluster, lock_states
from ..orchestrate.up import start_service
from ..output import console, emit_json, warn
from ..settings import Settings
from ..supervisor import STOPPED, Observation, Policy, Supervisor
from .common import globals_of, one_replica, open_cluster, settings_of

AUDIT_LOOKBACK = 500  # audit lines on the head the supervisor reads for a person's `down`


# ---------------------------------------------------------------------------------------- watch


class WatchOps:
    """The supervisor's hands. Holds one Cluster; a node that was lost is reconnected next round."""

    def __init__(self, g: Globals, s: Settings, policy: Policy, say: Any) -> None:
        self.g, self.s, self.policy, self._say = g, s, policy, say
        self.nodes = s.nodes
        self.cluster: Cluster | None = None
        self._stale = False
        self.me = new_owner("watch")
        self.since = self.me.since
        self.api: Any = None
        self._baseline: set[str] | None = None

    def start(self) -> None:
        """Connect, and note the `down` lines already there (separate from __init__: a signal while
        connecting still ends `watch` through its own ending, which publishes "stopped")."""
        from .. import readiness

        self._connect()
        self.api = readiness.HeadApi(service.head_base_url(self._c(), self.s), self.s.get("VLLM_API_KEY"),
                                     timeout=3)
        self._baseline = self._downs()  # `down` lines that were there before we started (None: not read yet)

    # -- connections
    def _connect(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        self.cluster = Cluster(self.s.nodes, self.g.ssh_config_path(), connect_timeout=10)
        self.cluster.connect()

    def _c(self) -> Cluster:
        assert self.cluster is not None
        return self.cluster

    def _head(self) -> Any:
        return self._c().node(self.s.head)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()

    # -- Ops
    def say(self, text: str) -> None:
        self._say(f"{_dt.datetime.now(_dt.UTC):%H:%M:%S} {text}")

    def observe(self, canary: bool) -> Observation:
        from .. import readiness

        c = self._c()
        if c.errors or self._stale:  # connect again (each round, while a node is away)
            self._connect()
            c = self._c()
        name = self.s.cluster_name
        results = c.run_all(lambda n: service.inspect_cluster(n, name), nodes=self.nodes)
        obs = Observation(ranks={})
        lost = False
        for rank, node in enumerate(self.nodes):
            res = results[node]
            if isinstance(res, NodeError):
                # No SSH, or no Docker engine (a rebooting node): wait for it rather than restart into it.
                obs.unreachable[node] = res.reason[:200]
                lost = lost or res.kind not in ("docker", "output")  # the SSH side: connect again
                continue
            mine = [x for x in res if x.rank == rank]
            if not mine:
                obs.ranks[rank] = "absent"
            elif not mine[0].running:
                obs.ranks[rank] = f"{mine[0].status} (exit {mine[0].exit_code})"
            else:
                obs.ranks[rank] = "running"
        self._stale = lost
        obs.health = self.api.health()
        if canary and obs.health == 200 and not obs.unreachable and all(v == "running" for v in obs.ranks.values()):
            try:
                self.api.chat(str(self.s.get("SERVED_MODEL_NAME")), "ping", max_tokens=1,
                              timeout=self.policy.canary_timeout_s)
                obs.canary = "ok"
            except readiness.BadAnswer as exc:
                obs.canary = f"bad answer: {exc.message[:120]}"
            except Exception as exc:  # a timeout, a refused connection, a 5xx: the head did not answer
                obs.canary = f"{type(exc).__name__} within {self.policy.canary_timeout_s:g}s"
        return obs

    def _downs(self) -> set[str] | None:
        try:
            r = self._head().run(audit_tail_argv(self.s.cluster_name, AUDIT_LOOKBACK), timeout=20)
        except NodeError:
            return None
        found = set()
        for line in r.stdout.splitlines():
            try:
                doc = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(doc, dict) and doc.get("action") == "down":
                found.add(line)
        return found

    def deliberate_stop(self) -> str | None:
        downs = self._downs()
        if downs is None:
            return None
        if self._baseline is None:  # the head was away when we started: what it has now is the past
            self._baseline = downs
            return None
        new = sorted(downs - self._baseline)
        if not new:
            return None
        doc = json.loads(new[-1])
        return f"`down` by {str(doc.get('who'))[:100]} at {str(doc.get('when'))[:40]}"

    def busy(self) -> str | None:
        c = self._c()  # the lock of any of the cluster's nodes: another command may change only some
        states = lock_states(c, self.nodes, self.s.cluster_name)
        others = {n: st for n, st in states.items() if st.owner.token != self.me.token}
        if not others:
            return None
        st = next(iter(others.values()))
        return f"{st.owner.describe()} (on {', '.join(others)})"

    def _audit(self, action: str, detail: str) -> None:
        c = self._c()
        try:
            service.audit(c, self.nodes, self.s.cluster_name,
                          {n: [audit_line(action=action, detail=detail)] for n in self.nodes})
        except Exception:  # the audit must never stop the supervisor
            pass

    def restart(self, reason: str, attempt: int) -> None:
        from .. import readiness
        from ..supervisor import WatchEnded

        c = self._c()
        require_all(c, "restart refused")
        t0 = time.monotonic()
        self._audit("watch-restart", f"attempt {attempt}/{self.policy.max_restarts}: {reason}")
        try:
            with lock_cluster(c, self.nodes, self.s.cluster_name, "watch-restart"):
                who = self.deliberate_stop()
                if who:
                    raise WatchEnded(0, f"the service was stopped on purpose ({who}); the supervisor stops too")
                start_service(c, self.s, recreate=True, say=self.say, source="sparkctl watch")
        except WatchEnded:
            raise
        except BaseException as exc:
            self._restart_failed(attempt, exc)
            raise
        # `up`'s point of no return is behind us: signals stop `watch` again (one that arrived during
        # the start is raised here), also during the wait, which may take an hour.
        signals.reopen()
        try:
            # The wait runs without the lock, so a person can still `down` a slow load.
            readiness.wait_ready(c, self.s, self.api, timeout=self.policy.ready_timeout_s, prompt="ping")
        except BaseException as exc:
            self._restart_failed(attempt, exc)
            raise
        self._audit("watch-restarted", f"attempt {attempt}: serving again after {time.monotonic() - t0:.1f}s")
        self.say(f"restarted: serving again after {time.monotonic() - t0:.1f}s")

    def _restart_failed(self, attempt: int, exc: BaseException) -> None:
        if isinstance(exc, KeyboardInterrupt):  # a signal: `up` rolled back what it started; watch ends
            why = f"interrupted ({signals.signal_name(exc.signum)})" if isinstance(exc, signals.Interrupted) \
                else "interrupted"
        else:
            why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        self._audit("watch-restart-failed", f"attempt {attempt}: {why}")

    def give_up(self, reason: str) -> None:
        c = self._c()
        self._audit("watch-gave-up", reason)
        try:
            with lock_cluster(c, self.nodes, self.s.cluster_name, "watch-give-up"):
                service.down(c, self.s)
        except Exception as exc:  # report, and still end: the reason is what matters
            self.say(f"could not take everything down: {str(exc).splitlines()[0][:300]}")

    def publish(self, doc: dict[str, Any]) -> None:
        full = {**doc, "pid": os.getpid(), "who": whoami(), "since": self.since,
                "updated": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "updated_epoch": time.time(),
                "interval_s": self.policy.interval_s}
        if self.cluster is None or self.s.head not in self.cluster.connected:
            return  # not connected (yet): the next round writes
        try:
            watchstate.write_state(self._head(), self.s.cluster_name, full)
        except NodeError:
            pass  # the head is away; the next round writes again


@click.command("watch")
@click.pass_context
def watch_cmd(ctx: click.Context) -> None:
    """Supervise the service: a dead rank, a hung head or a lost node restarts the whole group.

    Runs in the foreground until a person runs `sparkctl down` (exit 0) or the restart budget is spent
    (WATCH_MAX_RESTARTS within WATCH_RESTART_WINDOW_S: the cluster is left down, exit 1). SIGINT,
    SIGTERM and SIGHUP end it with 128 + the signal's number, after it has published "stopped".
    """
    g = globals_of(ctx)
    s = one_replica(settings_of(g), "watch")
    policy = Policy.from_settings(s)
    out = console(True)  # progress lines go to stderr (a log); --json prints the end as one document
    ops = WatchOps(g, s, policy, say=lambda m: out.print(m, markup=False))
    sup = Supervisor(ops, policy)
    # The first signal is the stop: the first one decides the status and the ones after it (`timeout`
    # sends SIGTERM twice: to the process and to its group) cannot cut the publish of "stopped" short.
    signals.end_on_first()
    try:
        ops.start()
        ops.say(f"watching cluster {s.cluster_name} ({' '.join(s.nodes)}): every {policy.interval_s:g}s, canary "
                f"every {policy.canary_every_s:g}s, at most {policy.max_restarts} restarts in {policy.window_s:g}s")
        code = sup.run()
    except KeyboardInterrupt as exc:
        signals.commit()  # already so for a signal (end_on_first); for any other KeyboardInterrupt too
        got = signals.received()
        signum = exc.signum if isinstance(exc, signals.Interrupted) else got[0] if got else signal.SIGINT
        sup.state, sup.detail = STOPPED, f"stopped by {signals.signal_name(signum)}"
        ops.say(f"{signals.signal_name(signum)}: stopping (publishing the stopped state; a further signal "
                "changes nothing)")
        ops.publish({"state": sup.state, "detail": sup.detail, "restarts": sup.restarts,
                     "last_reason": sup.last_reason})
        code = 128 + signum
    finally:
        ops.close()
    reason = sup.detail or sup.state
    if g.json:
        emit_json({"exit": code, "state": sup.state, "reason": reason, "restarts": sup.restarts})
    else:
        ops.say(f"watch ends ({code}): {reason}")
    sys.exit(code)


# -------------------------------------------------------------------------------- history, rollback


@click.command("history")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.pass_context
def history_cmd(ctx: click.Context, limit: int) -> None:
    """What `up` started on this cluster, newest first: when, by whom, image content hash, config."""
    g = globals_of(ctx)
    s = settings_of(g)
    with open_cluster(g, s) as cluster:
        releases = read_history(cluster.node(s.head), s.cluster_name)[:limit]
    if g.json:
        emit_json({"cluster": s.cluster_name, "history": [r.as_dict() for r in releases]})
        return
    out = console(False)
    if not releases:
        out.print(f"cluster {s.cluster_name}: no history yet (`up` records every service it starts)", markup=False)
    for r in releases:
        out.print(f"{r.n:>3}  {r.when}  {r.who}  config {r.config_hash}  image {r.image} "
                  f"content {(r.image_content_hash or 'unknown')[:12]}  ({r.source})", markup=False)


@click.command("rollback")
@click.option("--to", "to", metavar="N|HASH", help="History entry number (1 = newest) or a config/content hash.")
@click.pass_context
def rollback_cmd(ctx: click.Context, to: str | None) -> None:
    """Bring a previous service back (default: the one before the newest) through `up`'s own path."""
    g = globals_of(ctx)
    s0 = one_replica(settings_of(g), "rollback")
    with open_cluster(g, s0) as cluster:
        require_all(cluster, "rollback refused")
        head = cluster.node(s0.head)
        target = pick(read_history(head, s0.cluster_name), to)
        now = content_hash_on(head, target.image)
        g.extra_overrides = {**g.extra_overrides, **rollback_overrides(target, now)}
        s = settings_of(g)
        if s.nodes != s0.nodes or s.cluster_name != s0.cluster_name:
            raise UsageError(f"history entry {target.n} ran on other nodes or another cluster name",
                             fix="roll back by hand with `up` and the knobs it shows in `sparkctl history --json`")
        out = console(g.json)
        out.print(f"rolling back to entry {target.n}: {target.when} by {target.who}, image "
                  f"{s.get('IMAGE')}, config {target.config_hash}", markup=False)
        with lock_cluster(cluster, s.nodes, s.cluster_name, "rollback"):
            outcome = start_service(cluster, s, recreate=False, say=lambda m: out.print(m, markup=False),
                                    source="sparkctl rollback")
    doc = {"changed": outcome.changed, "config_hash": outcome.config_hash, "image": s.get("IMAGE"),
           "entry": target.as_dict()}
    if outcome.config_hash != target.config_hash:
        why = "the image is now named by its content-hash tag" if s.get("IMAGE") != target.image \
            else "the fabric pins or a secret differ from then"
        warn([f"the config hash is {outcome.config_hash}, not the recorded {target.config_hash}: {why}"])
    if g.json:
        emit_json(doc)
    else:
        out.print(f"rollback: running image {s.get('IMAGE')} with config {outcome.config_hash}"
                  + ("" if outcome.changed else " (it was already running)") + "; next: `sparkctl wait`",
                  markup=False)


# ----------------------------------------------------------------------------------------- exec


@click.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--rank", type=int, default=0, show_default=True, help="The rank whose container runs it.",
              shell_complete=rank_numbers)
@click.option("--replica", type=int, default=0, show_default=True, help="The replica of that rank.")
@click.option("--timeout", type=float, default=600, show_default=True, help="Seconds before it is stopped.")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, required=True)
@click.pass_context
def exec_cmd(ctx: click.Context, rank: int, replica: int, timeout: float, argv: tuple[str, ...]) -> None:
    """Run a command in a rank's container: `sparkctl exec --rank 2 -- nvidia-smi -L` (argv, no shell)."""
    g = globals_of(ctx)
    s = settings_of(g).replica(replica)  # one replica: the settings themselves
    words = list(argv)
    if not words:
        raise UsageError("give the command after `--`: sparkctl exec --rank N -- CMD ARGS...")
    ranks = s.service.ranks
    if not 0 <= rank < len(ranks):
        raise UsageError(f"--rank {rank}: ranks are 0..{len(ranks) - 1}")
    node_name = ranks[rank].node
    with Cluster([node_name], g.ssh_config_path()) as cluster:
        node = cluster.node(node_name)
        r = node.run(["docker", "exec", container_name(s.cluster_name, rank), *words], timeout=timeout)
    if g.json:
        emit_json({"rank": rank, "node": node_name, "exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr})
    else:
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
    sys.exit(r.exit_code if 0 <= r.exit_code < 256 else 1)


# ----------------------------------------------------------------------------------- export systemd


@click.group("export")
def export_cmd() -> None:
    """Export the supervisor for another manager (`export systemd`)."""


@export_cmd.command("systemd")
@click.option("--print", "print_only", is_flag=True, help="Print the unit instead of installing it.")
@click.option("--node", help="Install on this node (default: the head).")
@click.option("--sparkctl", "program", metavar="PATH",
              help="The sparkctl on that node (default: this one's Python, `-m sparkctl`).")
@click.pass_context
def export_systemd_cmd(ctx: click.Context, print_only: bool, node: str | None, program: str | None) -> None:
    """A systemd unit that runs `sparkctl watch` for this cluster, after docker and the network."""
    from ..systemd_unit import install_argv, pinned_environment, unit_name, unit_text

    g = globals_of(ctx)
    s = one_replica(settings_of(g), "export systemd")
    target = node or s.head
    if target not in s.nodes:
        raise UsageError(f"--node {target}: not one of this cluster's nodes ({' '.join(s.nodes)})")
    argv = shlex.split(program) if program else [sys.executable, "-m", "sparkctl"]
    if s.env_file is not None:
        argv += ["--env-file", str(s.env_file.resolve())]
    argv += ["--recipe", str(s.recipe.path if s.get("RECIPE", "").endswith(".toml") else s.recipe.name), "watch"]
    env, warnings = pinned_environment(s, os.path.abspath(g.ssh_config_path()))
    warn(warnings)
    text = unit_text(cluster=s.cluster_name, argv=argv, env=env)
    name = unit_name(s.cluster_name)
    if print_only:
        if g.json:
            emit_json({"unit": name, "text": text})
        else:
            sys.stdout.write(text)
        return
    with Cluster([target], g.ssh_config_path()) as cluster:
        r = cluster.node(target).run(install_argv(s.cluster_name), stdin=text.encode(), timeout=60)
    hints = {4: f"installing a unit needs root on {target}: log in as root, or install the `--print` output",
             5: f"{target} has no systemctl: the unit is written to /etc/systemd/system/{name} but not enabled",
             3: f"cannot write /etc/systemd/system/{name} on {target}"}
    if r.exit_code in hints:
        raise CheckFailed(hints[r.exit_code], fix="`sparkctl export systemd --print` shows the unit")
    if not r.ok:
        raise CheckFailed(f"systemctl on {target} failed: {(r.stderr.strip() or r.stdout.strip())[:300]}",
                          fix=f"`systemctl status {name}` on {target}")
    if g.json:
        emit_json({"unit": name, "node": target, "installed": True})
    else:
        console(False).print(f"installed and started {name} on {target}; `sparkctl down` stops and disables it",
                             markup=False)


COMMANDS = {
    "watch": watch_cmd,
    "history": history_cmd,
    "rollback": rollback_cmd,
    "exec": exec_cmd,
    "export": export_cmd,
}
