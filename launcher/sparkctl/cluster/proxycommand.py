"""ProxyCommand: the command's stdin and stdout as the SSH transport's socket, run the way ssh(1) runs it
(`$SHELL -c "exec COMMAND"`, tokens already expanded by sshconfig). The host key behind it is judged
against known_hosts like any other (transport.connect); the command only carries the bytes.

paramiko.ProxyCommand is the model, with what a long-lived cluster connection needs on top: the command
runs in its own session (a Ctrl-C at the terminal does not kill the tunnel that cleanup still needs), its
end of stream is an end of stream (paramiko's spins until its timeout), its stderr goes to ours line by
line (a tunnel's login URL must reach the user, as it would under ssh) and its last lines are kept for
the error that says why it failed, and close() reaps it.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import subprocess
import sys

import paramiko

from ..threads import spawn

_TAIL_LINES = 8


class ProxyCommandSocket(paramiko.ProxyCommand):
    """The socket-like object paramiko.Transport reads and writes (send, recv, settimeout, close)."""

    def __init__(self, command: str, label: str) -> None:  # noqa: D107 -- no super().__init__: it would run shlex.split(command)
        self.cmd = command  # type: ignore[assignment]  # paramiko's is the argv; its messages join it
        self.label = label
        self.timeout: float | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._eof = False  # it closed its stdout (it is ending, or has ended)
        self._killed = False  # close() ended it: its status says nothing about the command
        shell = os.environ.get("SHELL") or "/bin/sh"
        self.process = subprocess.Popen(
            [shell, "-c", f"exec {command}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, bufsize=0, start_new_session=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._out = self.process.stdout.fileno()
        self._in = self.process.stdin.fileno()
        os.set_blocking(self._in, False)  # send() writes what fits, as a socket's send does
        self._relayed = spawn(self._relay_stderr, f"proxycommand-{label}")  # set once stderr has ended

    def _relay_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in iter(self.process.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            self._tail.append(line)
            try:
                print(f"{self.label}: ProxyCommand: {line}", file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass

    def send(self, content: bytes) -> int:  # type: ignore[override]
        _, writable, _ = select.select([], [self._in], [], self.timeout)
        if not writable:
            raise TimeoutError()
        try:
            return os.write(self._in, content)
        except BlockingIOError:
            return 0

    def recv(self, size: int) -> bytes:
        readable, _, _ = select.select([self._out], [], [], self.timeout)
        if not readable:
            raise TimeoutError()
        data = os.read(self._out, size)  # b"" when the command closed its stdout: EOF, as a socket says it
        self._eof = self._eof or not data
        return data

    def _ended_by_itself(self, grace: float) -> int | None:
        if self.process.poll() is None and self._eof:  # past its stdout: let it finish exiting
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        return None if self._killed else self.process.poll()

    def exited(self) -> int | None:
        """The command's exit status if it ended by itself (None: it runs, or close() ended it)."""
        return self._ended_by_itself(0.5)

    def why(self) -> str:
        """What the command said on stderr last, for an error message."""
        self._relayed.wait(0.5)
        return " | ".join(line for line in self._tail if line)[-400:]

    def close(self) -> None:
        if self._ended_by_itself(1.0) is None and self.process.poll() is None:
            self._killed = True
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=2)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    @property
    def closed(self) -> bool:
        return self.process.poll() is not None

    @property
    def _closed(self) -> bool:
        return self.closed

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout
