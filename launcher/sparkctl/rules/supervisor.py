"""`sparkctl watch`: keep the service serving, by restarting the whole group together.

A multi-node TP group cannot heal one rank at a time (a restarted worker cannot rejoin a running
NCCL group), so per-container restart policies are the wrong tool. The supervisor looks every
WATCH_INTERVAL_S at every rank's container and the head's /health, and every WATCH_CANARY_S sends
one tiny completion. A dead rank, a hung head or a vanished node leads to one coordinated restart of
the group (down, up, wait) under the cluster lock, audited, with the settings it was started with.

Restarts are bounded: the first is immediate, later ones in the same window back off exponentially,
and after WATCH_MAX_RESTARTS within WATCH_RESTART_WINDOW_S it tears the cluster down and exits 1 with
the reason. A `down` run by a person (seen in the head's audit log) ends it with exit 0.

The loop (`Supervisor.run`) is pure policy over an `Ops` object, so it is unit-tested with a fake;
`orchestrate/watch.py` (`WatchOps`) supplies the real one (SSH, Docker, HTTP).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..spec.settings import Settings

# Supervisor states, as `status` shows them.
WATCHING = "watching"
RESTARTING = "restarting"
BACKOFF = "backoff"
WAITING_FOR_NODE = "waiting-for-node"
BUSY = "lock-held-by-another-command"
GAVE_UP = "gave-up"
STOPPED = "stopped"


@dataclass(frozen=True)
class Policy:
    """The supervisor's knobs (recipe or env file; defaults here)."""

    interval_s: float = 5.0
    canary_every_s: float = 30.0
    canary_timeout_s: float = 30.0
    max_restarts: int = 3
    window_s: float = 3600.0
    backoff_s: float = 10.0
    backoff_max_s: float = 300.0
    node_wait_s: float = 600.0
    ready_timeout_s: float = 3600.0
    health_failures: int = 2  # consecutive bad /health answers before a restart (one can be a blip)

    @classmethod
    def from_settings(cls, s: Settings) -> Policy:
        d = cls()

        def num(key: str, default: float) -> float:
            v = s.get(key)
            return default if v is None else float(v)

        return cls(
            interval_s=num("WATCH_INTERVAL_S", d.interval_s),
            canary_every_s=num("WATCH_CANARY_S", d.canary_every_s),
            canary_timeout_s=num("WATCH_CANARY_TIMEOUT_S", d.canary_timeout_s),
            max_restarts=int(num("WATCH_MAX_RESTARTS", d.max_restarts)),
            window_s=num("WATCH_RESTART_WINDOW_S", d.window_s),
            backoff_s=num("WATCH_BACKOFF_S", d.backoff_s),
            backoff_max_s=max(num("WATCH_BACKOFF_S", d.backoff_s), d.backoff_max_s),
            node_wait_s=num("WATCH_NODE_WAIT_S", d.node_wait_s),
            ready_timeout_s=num("WATCH_READY_TIMEOUT_S", d.ready_timeout_s),
        )


class Budget:
    """At most `max_restarts` restarts within any `window_s`; the n-th restart of a window waits
    backoff_s·2^(n-1) first (the first one not at all: a healthy cluster's rare fault heals fastest)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.attempts: list[float] = []

    def recent(self, now: float) -> list[float]:
        return [t for t in self.attempts if now - t < self.policy.window_s]

    def allows(self, now: float) -> bool:
        return len(self.recent(now)) < self.policy.max_restarts

    def delay(self, now: float) -> float:
        n = len(self.recent(now))
        return 0.0 if n == 0 else min(self.policy.backoff_s * 2 ** (n - 1), self.policy.backoff_max_s)

    def spend(self, now: float) -> int:
        self.attempts.append(now)
        return len(self.recent(now))


@dataclass
class Observation:
    """One look at the cluster. ranks: rank -> "running", or what is wrong with it."""

    ranks: dict[int, str]
    unreachable: dict[str, str] = field(default_factory=dict)  # node -> why
    health: int | None = None
    canary: str | None = None  # None: not tried this round; "ok"; else what went wrong


def diagnose(obs: Observation, nodes: list[str], bad_health_rounds: int, policy: Policy) -> str | None:
    """Why the group must be restarted, or None when it serves. Pure."""
    if obs.unreachable:
        return "; ".join(f"node {n} unreachable ({why})" for n, why in obs.unreachable.items())
    dead = [f"rank {r} ({nodes[r]}) {state}" for r, state in sorted(obs.ranks.items()) if state != "running"]
    if dead:
        return "; ".join(dead)
    if obs.canary not in (None, "ok"):
        return f"head hung: /health {obs.health} but no completion ({obs.canary})"
    if obs.health != 200 and bad_health_rounds >= policy.health_failures:
        return f"head /health {obs.health if obs.health is not None else 'no answer'} " \
               f"{bad_health_rounds} times in a row"
    return None


class Ops(Protocol):
    """What the loop needs from the world; `orchestrate.watch.WatchOps` is the real one."""

    nodes: list[str]

    def observe(self, canary: bool) -> Observation: ...
    def deliberate_stop(self) -> str | None: ...  # "who ran `down` when", or None
    def busy(self) -> str | None: ...  # another command holds the cluster lock: who
    def restart(self, reason: str, attempt: int) -> None: ...  # raises on failure
    def give_up(self, reason: str) -> None: ...  # leave the cluster down and clean
    def publish(self, doc: dict[str, Any]) -> None: ...  # the state file `status` reads
    def say(self, text: str) -> None: ...


class WatchEnded(Exception):  # noqa: N818 - not an error: how the loop reports its end
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Supervisor:
    def __init__(self, ops: Ops, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, max_rounds: int | None = None) -> None:
        self.ops = ops
        self.policy = policy
        self.budget = Budget(policy)
        self.clock = clock
        self.sleep = sleep
        self.max_rounds = max_rounds  # for tests; None: until stopped
        self.state = WATCHING
        self.detail = ""
        self.restarts = 0
        self.last_reason = ""
        self._bad_health = 0
        self._last_canary = -1e18
        self._node_lost_at: float | None = None

    def _publish(self, state: str, detail: str = "") -> None:
        changed = (state, detail) != (self.state, self.detail)
        self.state, self.detail = state, detail
        if changed and detail:
            self.ops.say(f"{state}: {detail}")
        self.ops.publish({"state": state, "detail": detail, "restarts": self.restarts,
                          "restarts_in_window": len(self.budget.recent(self.clock())),
                          "max_restarts": self.policy.max_restarts, "last_reason": self.last_reason})

    def run(self) -> int:
        """Until a deliberate `down` (0) or an exhausted budget / a node gone for good (1)."""
        try:
            rounds = 0
            while self.max_rounds is None or rounds < self.max_rounds:
                rounds += 1
                self.round()
                self.sleep(self.policy.interval_s)
            return 0
        except WatchEnded as end:
            self._publish(STOPPED if end.code == 0 else GAVE_UP, end.reason)
            return end.code

    def _stop_if_deliberate(self) -> None:
        who = self.ops.deliberate_stop()
        if who:
            raise WatchEnded(0, f"the service was stopped on purpose ({who}); the supervisor stops too")

    def round(self) -> None:
        self._stop_if_deliberate()
        holder = self.ops.busy()
        if holder:
            self._publish(BUSY, holder)
            return
        now = self.clock()
        canary = now - self._last_canary >= self.policy.canary_every_s
        obs = self.ops.observe(canary)
        if canary and obs.canary is not None:
            self._last_canary = now
        self._bad_health = 0 if obs.health == 200 else self._bad_health + 1
        reason = diagnose(obs, self.ops.nodes, self._bad_health, self.policy)
        if reason is None:
            self._node_lost_at = None
            self._publish(WATCHING, "")
            return
        if obs.unreachable:
            # Nothing can be restarted without every node: wait for it (bounded), then restart.
            if self._node_lost_at is None:
                self._node_lost_at = now
            waited = now - self._node_lost_at
            if waited >= self.policy.node_wait_s:
                self._end_down(f"{reason}; waited {waited:.0f}s (WATCH_NODE_WAIT_S)")
            self._publish(WAITING_FOR_NODE, f"{reason}; waiting up to {self.policy.node_wait_s - waited:.0f}s more")
            return
        if self._node_lost_at is not None:
            reason = f"node back after {now - self._node_lost_at:.0f}s; {reason}"
            self._node_lost_at = None
        self._restart(reason)

    def _restart(self, reason: str) -> None:
        now = self.clock()
        if not self.budget.allows(now):
            self._end_down(f"{reason}; {self.policy.max_restarts} restarts within "
                           f"{self.policy.window_s:g}s already (WATCH_MAX_RESTARTS, WATCH_RESTART_WINDOW_S)")
        delay = self.budget.delay(now)
        if delay > 0:
            self._publish(BACKOFF, f"{reason}; restarting in {delay:g}s")
            self.sleep(delay)
        self._stop_if_deliberate()  # what we saw may be a person's `down` that just finished
        attempt = self.budget.spend(self.clock())
        self.restarts += 1
        self.last_reason = reason
        self._publish(RESTARTING, f"attempt {attempt}/{self.policy.max_restarts}: {reason}")
        try:
            self.ops.restart(reason, attempt)
        except WatchEnded:
            raise
        except Exception as exc:  # the next round sees what is left and decides (budget permitting)
            self.ops.say(f"restart attempt {attempt} failed: {str(exc).splitlines()[0][:300]}")
            self._stop_if_deliberate()
            return
        self._bad_health = 0
        self._last_canary = self.clock()  # the restart's `wait` ended with a real completion
        self._publish(WATCHING, "")

    def _end_down(self, reason: str) -> None:
        self._publish(GAVE_UP, reason)
        self.ops.give_up(reason)
        raise WatchEnded(1, f"gave up: {reason}; the cluster was left down")
