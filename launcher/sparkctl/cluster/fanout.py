"""Fan-out: a Cluster connects to every node in parallel and runs a job on each at once."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

import paramiko

from ..errors import CheckFailed, NodeError, UsageError
from ..facts.machine_identity import refuse_duplicates
from .channel import DEFAULT_COMMAND_TIMEOUT, Node, RunResult, remote_command
from .sshconfig import SshTarget, load_ssh_config, resolve_target
from .transport import DEFAULT_CONNECT_TIMEOUT, Jumps, KeyCache, connect

T = TypeVar("T")


class Results(dict[str, T | NodeError]):
    """What a fan-out gives back: every node, in order, with its result or the NodeError that stopped
    it (a dict, so `results[node]` and `.items()` work as before). `.ok` and `.failed` split it;
    `.raise_if_failed(what)` refuses to go on when any node failed, naming each one and its fix."""

    @property
    def ok(self) -> dict[str, T]:
        """node -> result, for the nodes that answered."""
        return {n: r for n, r in self.items() if not isinstance(r, NodeError)}

    @property
    def failed(self) -> dict[str, NodeError]:
        """node -> NodeError, for the nodes that did not."""
        return {n: r for n, r in self.items() if isinstance(r, NodeError)}

    def raise_if_failed(self, what: str) -> None:
        """CheckFailed("WHAT on N node(s): ...") naming every failed node, its reason and its fix."""
        raise_failed(what, self.failed)


def raise_failed(what: str, failed: Mapping[str, NodeError]) -> None:
    """Raise CheckFailed for these nodes' failures (nothing when there are none): one line per node,
    `NODE: REASON (fix: FIX)`."""
    if not failed:
        return
    lines = [f"{n}: {e.reason}" + (f" (fix: {e.fix})" if e.fix else "") for n, e in failed.items()]
    only = next(iter(failed)) if len(failed) == 1 else None
    raise CheckFailed(f"{what} on {len(failed)} node(s):\n  " + "\n  ".join(lines), node=only,
                      failures=[e.as_dict() for e in failed.values()])


def parallel(jobs: Sequence[Callable[[], T]], *, limit: int = 64) -> list[T]:
    """Run the jobs side by side (a thread each, at most `limit` at a time) and wait for all of them:
    their results, in order. When jobs raised, the first of them (in order) raises here, once every
    job has ended. For one node's independent jobs (channels on its one connection run side by side)
    or jobs across nodes that are not one `run_all`."""
    if not jobs:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(limit, len(jobs))),
                                               thread_name_prefix="job") as pool:
        futures = [pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures)
    return [f.result() for f in futures]


class Cluster:
    """Connections to a set of nodes. Use as a context manager: entering connects to every node in
    parallel (one SSH connection each); leaving closes them all."""

    def __init__(
        self,
        nodes: Sequence[str],
        ssh_config: str | Path | None = None,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        if not nodes:
            raise UsageError("no nodes given", fix="set NODES (or --nodes) to the SSH aliases of your nodes")
        dupes = sorted({n for n in nodes if list(nodes).count(n) > 1})
        if dupes:
            raise UsageError(f"node(s) listed twice: {', '.join(dupes)}", fix="list each node once in NODES")
        self.names: list[str] = list(nodes)
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self._config, self.ssh_config_path = load_ssh_config(ssh_config)
        self._nodes: dict[str, Node] = {}
        self._targets: dict[str, SshTarget] = {}
        self.errors: dict[str, NodeError] = {}
        self._keys = KeyCache()
        self._jumps = Jumps()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(64, len(nodes)), thread_name_prefix="node"
        )
        self.connect_seconds: float = 0.0

    def __enter__(self) -> Cluster:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def target(self, name: str) -> SshTarget:
        """What `ssh -G` resolves `name` to, asked once per Cluster (a connected node keeps its own)."""
        node = self._nodes.get(name)
        if node is not None:
            return node.target
        got = self._targets.get(name)
        if got is None:
            got = self._targets[name] = resolve_target(name, self._config, self.ssh_config_path)
        return got

    def connect(self) -> None:
        """Open every node's connection in parallel. Failures land in .errors, never raise."""
        start = time.monotonic()

        def one(name: str) -> Node:
            target = self.target(name)
            def again() -> paramiko.Transport:
                return connect(target, timeout=self.connect_timeout, keys=self._keys, jumps=self._jumps)

            return Node(target, again(), command_timeout=self.command_timeout, reconnect=again)

        todo = [n for n in self.names if n not in self._nodes and n not in self.errors]
        for name, result in zip(todo, self._pool.map(lambda n: _capture(n, one), todo), strict=True):
            if isinstance(result, NodeError):
                self.errors[name] = result
            else:
                self._nodes[name] = result
        self.connect_seconds = time.monotonic() - start
        # One machine reached under two names would run two ranks: refuse it (facts/machine_identity.py).
        refuse_duplicates([n.identity() for n in self._nodes.values()], self.ssh_config_path)

    @property
    def connected(self) -> list[str]:
        return [n for n in self.names if n in self._nodes]

    def node(self, name: str) -> Node:
        """The connected node, or its NodeError raised (why it could not be reached)."""
        if name in self.errors:
            raise self.errors[name]
        if name not in self._nodes:
            raise UsageError(f"{name!r} is not one of this cluster's nodes ({' '.join(self.names)})")
        return self._nodes[name]

    @overload
    def run_all(
        self,
        job: Sequence[str],
        *,
        stdin: bytes | None = ...,
        timeout: float | None = ...,
        env: Mapping[str, str] | None = ...,
        nodes: Sequence[str] | None = ...,
    ) -> Results[RunResult]: ...

    @overload
    def run_all(
        self,
        job: Callable[[Node], T],
        *,
        stdin: bytes | None = ...,
        timeout: float | None = ...,
        env: Mapping[str, str] | None = ...,
        nodes: Sequence[str] | None = ...,
    ) -> Results[T]: ...

    def run_all(
        self,
        job: Sequence[str] | Callable[[Node], Any],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        nodes: Sequence[str] | None = None,
    ) -> Results[Any]:
        """Run an argv (or call fn(node)) on every node at once. The answer (Results) has every node,
        in order: its result, or the NodeError that stopped it (unreachable nodes included)."""
        names = list(nodes) if nodes is not None else self.names
        if callable(job):
            fn = job
        else:
            argv = list(job)
            remote_command(argv, env)  # bad input fails here, once, not once per node

            def fn(node: Node) -> RunResult:
                return node.run(argv, stdin=stdin, timeout=timeout, env=env)

        def one(name: str) -> Any:
            return fn(self.node(name))

        return Results(zip(names, self._pool.map(lambda n: _capture(n, one), names), strict=True))

    def close(self) -> None:
        for node in self._nodes.values():
            try:
                node.close()
            except Exception:  # closing is best effort; the process is ending anyway
                pass
        self._nodes.clear()
        self._jumps.close()  # after the nodes: their connections run through the hops
        self._pool.shutdown(wait=False, cancel_futures=True)


def _capture(name: str, fn: Callable[[str], T]) -> T | NodeError:
    """fn(name), with any failure turned into that node's NodeError (nothing is lost in a fan-out)."""
    try:
        return fn(name)
    except NodeError as exc:
        return exc
    except (UsageError, CheckFailed) as exc:
        return NodeError(name, "error", exc.message, exc.fix)
    except Exception as exc:
        return NodeError(
            name, "error", f"{type(exc).__name__}: {exc}", "run with -vv and report this as a sparkctl bug"
        )
