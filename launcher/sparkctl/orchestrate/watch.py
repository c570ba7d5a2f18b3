"""`sparkctl watch`'s hands: `WatchOps`, what the supervisor (sparkctl.rules.supervisor, the policy) does on
the nodes -- one SSH connection per node, Docker, the head's HTTP API. Its restarts go through
`orchestrate.up.start_service`, the same path as `up`. The command (signals, printing): commands/watch.py.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from typing import Any

from .. import signals
from ..cluster import Cluster, NodeError
from ..facts.parsing import ParseError, parse_json
from ..remote import service, watchstate
from ..remote.lockdir import audit_line, audit_tail_argv, new_owner, whoami
from ..rules.supervisor import Observation, Policy
from ..spec.settings import Settings
from . import require_all
from .locking import lock_cluster, lock_states
from .up import start_service

AUDIT_LOOKBACK = 500  # audit lines on the head the supervisor reads for a person's `down`


class WatchOps:
    """The supervisor's hands. Holds one Cluster; a node that was lost is reconnected next round."""

    def __init__(self, ssh_config: Any, s: Settings, policy: Policy, say: Any) -> None:
        self.ssh_config, self.s, self.policy, self._say = ssh_config, s, policy, say
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
        from ..remote import readiness

        self._connect()
        self.api = readiness.HeadApi(service.head_base_url(self._c(), self.s), self.s.get("VLLM_API_KEY"),
                                     timeout=3)
        self._baseline = self._downs()  # `down` lines that were there before we started (None: not read yet)

    # -- connections
    def _connect(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        self.cluster = Cluster(self.s.nodes, self.ssh_config, connect_timeout=10)
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
        from ..remote import readiness

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
                why, _ = service.why_dead(c.node(node), mine[0])
                obs.ranks[rank] = f"{mine[0].status} (exit {mine[0].exit_code})" + (f": {why}" if why else "")
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
                doc = parse_json(line)
            except ParseError:
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
        doc = parse_json(new[-1])  # parsed above already
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
        from ..remote import readiness
        from ..rules.supervisor import WatchEnded

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
