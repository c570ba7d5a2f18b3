"""One node: commands, scripts, files and streams as channels on the node's one SSH transport."""

from __future__ import annotations

import re
import secrets
import select
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import paramiko

from ..errors import NodeError, UsageError
from ..facts.machine_identity import NodeIdentity
from ..facts.parsing import NotJson, ParseError, parse_json
from .hostkeys import fingerprint
from .sshconfig import SshTarget

DEFAULT_COMMAND_TIMEOUT = 60.0
MAX_OUTPUT_BYTES = 256 * 1024 * 1024  # per stream of one command; more means something is wrong
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    exit_code: int
    elapsed: float
    command: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


NodeResult = RunResult  # what run_all gives per node for an argv job


def remote_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The string the remote shell runs: every value one shell-quoted word (env via `env K=V`)."""
    if isinstance(argv, str):
        raise TypeError("argv must be a list of words, not a string (it would be run by the shell)")
    words = [str(a) for a in argv]
    if env:
        for name in env:
            if not _ENV_NAME.fullmatch(name):
                raise UsageError(f"bad environment variable name {name!r}")
        words = ["env", *(f"{k}={v}" for k, v in env.items()), *words]
    return shlex.join(words)


class Node:
    """A connected node. Every method runs over the node's one SSH transport."""

    def __init__(self, target: SshTarget, transport: paramiko.Transport, *, command_timeout: float,
                 reconnect: Callable[[], paramiko.Transport] | None = None) -> None:
        self.name = target.alias
        self.target = target
        self._transport = transport
        self._command_timeout = command_timeout
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_lock = threading.Lock()
        # paramiko's SFTPClient takes one request at a time: two threads writing at once on one node wait
        # for each other's replies for ever (two relay streams from one sender did)
        self._sftp_io = threading.Lock()
        # A connection that drops between commands (sshd, a NAT, a flaky link) is opened once more,
        # verified as the first was, and only once per Node: a node that keeps dropping is lost.
        self._reconnect = reconnect
        self._reconnect_lock = threading.Lock()
        self.reconnects = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<Node {self.name} {self.target.user}@{self.target.hostname}:{self.target.port}>"

    def identity(self, machine_id: str | None = None) -> NodeIdentity:
        """Who answered: the verified host key of this connection (and a machine-id, when read)."""
        try:
            key: str | None = fingerprint(self._transport.get_remote_server_key().asbytes())
        except Exception:  # a transport without a key (tests' stand-ins): unknown, not a match
            key = None
        return NodeIdentity(self.name, self.target.hostname, self.target.port, key, machine_id)

    def _lost(self, exc: BaseException, transport: paramiko.Transport | None = None) -> NodeError:
        why = f"{exc or type(exc).__name__}"
        # paramiko keeps what ended its connection (the peer's EOF, a socket error): say it too.
        cause = getattr(transport or self._transport, "saved_exception", None)
        if cause is not None and cause is not exc:
            why += f" (the connection had ended: {cause or type(cause).__name__})"
        return NodeError(self.name, "lost", f"SSH connection lost: {why}",
                         f"check {self.name} and its sshd, then run the command again")

    def _channel(self, timeout: float) -> paramiko.Channel:
        transport = self._transport
        try:
            return transport.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            fresh = self._fresh_transport(transport)
            if fresh is None:
                raise self._lost(exc, transport) from None
        try:
            return fresh.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc, fresh) from None

    def _fresh_transport(self, dead: paramiko.Transport) -> paramiko.Transport | None:
        """A new connection in place of `dead` when that one has ended (not merely refused a channel),
        the Node was not closed, and it has not been replaced before; None otherwise. Threads that
        find the same dead connection share one reconnect."""
        if self._reconnect is None or dead.is_active():
            return None
        with self._reconnect_lock:
            if self._transport is not dead:  # another thread reconnected already
                return self._transport if self._transport.is_active() else None
            if self._closed or self.reconnects >= 1:
                return None
            self.reconnects += 1
            try:
                fresh = self._reconnect()
            except NodeError:
                return None
            with self._sftp_lock:
                self._sftp = None  # it ran on the old connection
            self._transport = fresh
            return fresh

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run argv on the node and wait for it. A non-zero exit is a RunResult, not an error;
        a timeout or a lost connection is a NodeError."""
        return self.start(argv, timeout=timeout, env=env).finish(stdin or b"")

    def start(
        self, argv: Sequence[str], *, timeout: float | None = None, env: Mapping[str, str] | None = None
    ) -> Session:
        """Start argv on the node and return its Session, to talk to it in turns (see Session)."""
        return Session(self, remote_command(argv, env), self._command_timeout if timeout is None else timeout)

    def run_script(
        self,
        script: bytes,
        args: Sequence[str] = (),
        *,
        interpreter: Sequence[str] = ("sh", "-s", "--"),
        timeout: float | None = None,
    ) -> RunResult:
        """Ship a script on stdin: `sh -s -- ARGS < script` (or `python3 - ARGS`): one round trip,
        nothing written to the node's disk."""
        return self.run([*interpreter, *args], stdin=script, timeout=timeout)

    def open_stream(
        self, argv: Sequence[str], *, merge_stderr: bool = False, timeout: float | None = None
    ) -> Stream:
        """Start argv on the node with its input and output as byte streams (see Stream): for what
        run() cannot carry -- input fed as it comes, output read as it arrives. `merge_stderr`: stderr
        comes with stdout, in order. `timeout` bounds opening the channel (the command itself runs
        until it ends or the Stream is closed)."""
        return Stream(self, remote_command(argv), merge_stderr=merge_stderr,
                      open_timeout=self._command_timeout if timeout is None else timeout)

    def stream(
        self, argv: Sequence[str], *, stop: threading.Event | None = None, timeout: float | None = None
    ) -> Iterator[str]:
        """Yield the output lines (stdout and stderr together) of a long-running command such as
        `docker logs -f`, until it ends, `stop` is set, or `timeout` seconds pass (None: no limit)."""
        command = remote_command(argv)
        deadline = None if timeout is None else time.monotonic() + timeout
        chan = self._channel(self._command_timeout)
        buf = b""
        try:
            chan.set_combine_stderr(True)
            chan.exec_command(command)
            chan.shutdown_write()
            while not (stop is not None and stop.is_set()):
                if deadline is not None and time.monotonic() > deadline:
                    return
                select.select([chan], [], [], 0.2)
                while chan.recv_ready():
                    buf += chan.recv(65536)
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", errors="replace")
                if (chan.eof_received or chan.closed) and not chan.recv_ready():
                    break
            if buf and not (stop is not None and stop.is_set()):
                yield buf.decode("utf-8", errors="replace")
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc) from None
        finally:
            chan.close()

    def put_bytes(self, path: str, data: bytes, mode: int = 0o600) -> None:
        """Write `data` to `path` on the node over SFTP (same connection): the file gets `mode`
        before any byte is written, and appears atomically (written aside, then renamed)."""
        tmp = f"{path}.sparkctl-{secrets.token_hex(4)}"
        try:
            with self._sftp_lock:
                if self._sftp is None:
                    self._sftp = self._transport.open_sftp_client()
                sftp = self._sftp
            assert sftp is not None
            with self._sftp_io:
                with sftp.open(tmp, "wb") as f:
                    f.chmod(mode)
                    f.write(data)
                sftp.posix_rename(tmp, path)
        except OSError as exc:  # SFTP reports remote failures as IOError with the server's message
            raise NodeError(
                self.name,
                "sftp",
                f"cannot write {path}: {exc}",
                f"check that the folder exists and is writable for {self.target.user} on {self.name}",
            ) from None
        except (paramiko.SSHException, EOFError) as exc:
            raise self._lost(exc) from None

    def docker(
        self, args: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None
    ) -> RunResult:
        """The docker CLI on the node, talking to the engine the SSH session's DOCKER_HOST names."""
        return self.run(["docker", *args], stdin=stdin, timeout=timeout)

    def docker_json(self, args: Sequence[str], *, timeout: float | None = None) -> Any:
        """`docker ARGS` whose output is JSON: one document, or one per line (`--format '{{json .}}'`
        on a list command) returned as a list."""
        res = self.docker(args, timeout=timeout)
        if not res.ok:
            first = next((ln for ln in res.stderr.splitlines() if ln.strip()), f"exit status {res.exit_code}")
            raise NodeError(
                self.name,
                "docker",
                f"`docker {_short(shlex.join(args))}` failed: {first[:300]}",
                f"check the Docker engine on {self.name} (`docker version` there, DOCKER_HOST)",
            )
        text = res.stdout.strip()
        try:
            return parse_json(text) if text else None
        except ParseError:
            pass
        try:
            return [parse_json(line) for line in text.splitlines() if line.strip()]
        except NotJson as exc:
            raise NodeError(
                self.name,
                "output",
                f"`docker {_short(shlex.join(args))}` printed something that is not JSON ({exc.reason})",
            ) from None

    def host_key(self) -> tuple[str, str]:
        """(type, base64) of the host key this connection verified against known_hosts."""
        key = self._transport.get_remote_server_key()
        return key.get_name(), key.get_base64()

    def close(self) -> None:
        with self._reconnect_lock:
            self._closed = True
        with self._sftp_lock:
            if self._sftp is not None:
                self._sftp.close()
        self._transport.close()


def wait_channel(chan: paramiko.Channel, timeout: float) -> None:
    """Wait up to `timeout` for a channel's output or its end. After EOF the channel stays readable
    for select, which would then return at once, over and over, until the exit status comes: wait
    for that (or the close) instead."""
    if chan.eof_received:
        chan.status_event.wait(timeout)
    else:
        select.select([chan], [], [], timeout)


class Session:
    """One command on a node, talked to in turns: send some input and read until a marker shows up
    on stdout (`read_until`), then send the rest and wait for the end (`finish`). `check` uses it so
    that one probe per node does both rounds: the facts, then -- once every node's facts are in and
    the fabric addresses are known -- the reach test, on the same channel. `timeout` bounds it all."""

    def __init__(self, node: Node, command: str, timeout: float) -> None:
        self.node, self.command, self.timeout = node, command, timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.out, self.err = bytearray(), bytearray()
        self._chan = node._channel(timeout)
        try:
            self._chan.exec_command(command)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._chan.close()
            raise node._lost(exc) from None

    def _pump(self, stdin: bytes, *, eof: bool, marker: bytes | None) -> bool:
        """Feed stdin (then EOF, when `eof`) as the window allows while draining stdout and stderr
        -- a remote that writes a lot before reading would otherwise deadlock with us -- until
        `marker` is on stdout (True) or the command has ended and all is read (False)."""
        chan, pending = self._chan, memoryview(stdin)
        if eof and not pending:
            chan.shutdown_write()
        while True:
            if marker is not None and not pending and marker in self.out:
                return True
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise NodeError(
                    self.node.name,
                    "command-timeout",
                    f"`{_short(self.command)}` did not finish within {self.timeout:g}s",
                    f"check what hangs on {self.node.name}; raise the timeout if it is just slow",
                )
            while pending and chan.send_ready():
                n = chan.send(bytes(pending[:65536]))
                pending = pending[n:]
                if not pending and eof:
                    chan.shutdown_write()
            wait_channel(chan, 0.005 if pending else min(left, 0.2))
            while chan.recv_ready():
                self.out += chan.recv(65536)
            while chan.recv_stderr_ready():
                self.err += chan.recv_stderr(65536)
            if len(self.out) > MAX_OUTPUT_BYTES or len(self.err) > MAX_OUTPUT_BYTES:
                raise NodeError(
                    self.node.name, "output", f"`{_short(self.command)}` printed more than {MAX_OUTPUT_BYTES} bytes"
                )
            if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                if not chan.recv_ready() and not chan.recv_stderr_ready():
                    return False

    def read_until(self, marker: bytes, stdin: bytes = b"") -> bool:
        """Send stdin (keeping the input open) and read until `marker` is on stdout: True, or False
        when the command ended first. The output so far is in .out and .err."""
        try:
            return self._pump(stdin, eof=False, marker=marker)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self.close()
            raise self.node._lost(exc) from None
        except NodeError:
            self.close()
            raise

    def finish(self, stdin: bytes = b"") -> RunResult:
        """Send the rest of the input, close it, and wait for the command to end."""
        try:
            self._pump(stdin, eof=True, marker=None)
            code = self._chan.recv_exit_status()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self.node._lost(exc) from None
        finally:
            self._chan.close()
        return RunResult(
            self.out.decode("utf-8", errors="replace"),
            self.err.decode("utf-8", errors="replace"),
            code,
            time.monotonic() - self.started,
            self.command,
        )

    def poll(self, seconds: float) -> bool:
        """Read what the command prints for up to `seconds`, its input left open (for commands that
        run long and report as they go): True while it runs, False once it has ended and all is read.
        The caller may consume .out/.err between polls."""
        chan, end = self._chan, time.monotonic() + seconds
        try:
            while True:
                wait_channel(chan, max(0.0, min(0.2, end - time.monotonic())))
                while chan.recv_ready():
                    self.out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    self.err += chan.recv_stderr(65536)
                if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                    if not chan.recv_ready() and not chan.recv_stderr_ready():
                        return False
                if time.monotonic() >= end:
                    return True
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self.close()
            raise self.node._lost(exc) from None

    def close(self) -> None:
        """Abandon the command (its channel closes; the remote end sees EOF and a hangup)."""
        self._chan.close()


class StreamLost(NodeError):
    """The connection broke under a Stream (kind "lost"); `cause` is the transport's own words."""

    def __init__(self, node: Node, exc: BaseException) -> None:
        lost = node._lost(exc)
        super().__init__(node.name, lost.kind, lost.reason, lost.fix)
        self.cause = str(exc)


class Stream:
    """A command on a node whose input and output are byte streams, read and written as they go
    (`docker build` with its progress lines; one image stream from the head copied into many ranks'
    `docker load`). Made by Node.open_stream; close it (or use it as a context manager) when done.

        with node.open_stream(["docker", "load"], merge_stderr=True) as s:
            s.write(data); s.close_input()
            while not s.exited:
                out, _ = s.read(0.5)
            code = s.exit_status()

    A broken connection raises StreamLost (a NodeError of kind "lost")."""

    def __init__(self, node: Node, command: str, *, merge_stderr: bool, open_timeout: float) -> None:
        self.node, self.command = node, command
        self._chan = node._channel(open_timeout)
        try:
            self._chan.settimeout(None)  # writes block until the window lets them through
            if merge_stderr:
                self._chan.set_combine_stderr(True)
            self._chan.exec_command(command)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._chan.close()
            raise StreamLost(node, exc) from None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, data: bytes) -> None:
        """Send all of `data` to the command's stdin (blocks while the remote end is not reading)."""
        try:
            self._chan.sendall(data)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise StreamLost(self.node, exc) from None

    def close_input(self) -> None:
        """EOF on the command's stdin."""
        try:
            self._chan.shutdown_write()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise StreamLost(self.node, exc) from None

    def read(self, wait: float = 0.0, *, limit: int = 1 << 20) -> tuple[bytes, bytes]:
        """(stdout, stderr) that have arrived -- stdout up to about `limit` bytes, stderr all of it --
        waiting up to `wait` seconds for something when nothing is there yet. (b"", b""): nothing came
        (see `ended` and `exited` for why)."""
        chan = self._chan
        out, err = bytearray(), bytearray()
        try:
            if wait > 0 and not (chan.recv_ready() or chan.recv_stderr_ready()):
                wait_channel(chan, wait)
            while len(out) < limit and chan.recv_ready():
                out += chan.recv(min(1 << 18, limit - len(out)))
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise StreamLost(self.node, exc) from None
        return bytes(out), bytes(err)

    def _unread(self) -> bool:
        return bool(self._chan.recv_ready() or self._chan.recv_stderr_ready())

    @property
    def ended(self) -> bool:
        """The command's output is over (EOF, or the channel closed) and all of it has been read."""
        return bool(self._chan.eof_received or self._chan.closed) and not self._unread()

    @property
    def exited(self) -> bool:
        """The command's exit status is in, its output is over and all of it has been read. (sshd may
        send the exit status before the last output and the EOF: the status alone is not the end.)"""
        return bool(self._chan.exit_status_ready()) and self.ended

    def exit_status(self) -> int:
        """The command's exit status (waits for it)."""
        try:
            return int(self._chan.recv_exit_status())
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise StreamLost(self.node, exc) from None

    def close(self) -> None:
        """Abandon the command (its channel closes; the remote end sees EOF and a hangup)."""
        self._chan.close()


def docker_json(node: Node, args: Sequence[str], *, timeout: float | None = None) -> Any:
    return node.docker_json(args, timeout=timeout)


def _short(command: str, limit: int = 120) -> str:
    return command if len(command) <= limit else command[: limit - 3] + "..."
