"""Nodes without SSH, for offline tests of whole commands: every remote command really runs.

`local_nodes(...)` replaces the SSH transport under `sparkctl.cluster` (the `connect` Cluster calls) with one
that runs each channel's command the way sshd would -- `sh -c COMMAND` in the node's home -- but on this
machine, in a per-node folder, with a PATH whose `docker` is a small stateful stand-in (stub_docker.py)
that records every call. Everything above the transport is sparkctl's real code: Cluster, Node,
Session, streams (build's too), SFTP writes (to the node's folder), the probes and scripts.

So a value that a command interpolates into a shell script runs as code here exactly as it would on a
node: a `$(touch CANARY)` in it creates the canary. The harness also records every command string and
every stdin/file it carried, so a test can count which commands a value reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

STUB_DOCKER = Path(__file__).resolve().parent / "stub_docker.py"
# Each node's /var/tmp (sparkctl.remote.lockdir.LOCK_ROOT): a folder of the node's, relative to the login directory.
MACHINE_TMP = "var-tmp"


@dataclass
class Sent:
    node: str
    command: str
    stdin: bytearray = field(default_factory=bytearray)


@dataclass
class LocalNodes:
    root: Path
    names: list[str]
    sent: list[Sent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    user: str | None = None  # another SSH user of the same machines (login_as); None: the nodes' own

    def home(self, name: str) -> Path:
        """The node's folder: its own user's home, and the machine (its MACHINE_TMP is the node's /var/tmp)."""
        return self.root / "nodes" / name

    def login_as(self, user: str | None) -> None:
        """From now on log in as another SSH user (None: the nodes' own): another home on each node, the
        same machine -- the same MACHINE_TMP (a link to the node's) -- and the same uid."""
        self.user = user

    def login_home(self, name: str) -> Path:
        if self.user is None:
            return self.home(name)
        home = self.root / "users" / self.user / name
        if not home.exists():
            home.mkdir(parents=True)
            (home / MACHINE_TMP).symlink_to(self.home(name) / MACHINE_TMP)
        return home

    def docker_calls(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every `docker` invocation, in order: {"node", "argv", "seq"}."""
        log = self.root / "docker-calls.jsonl"
        calls = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
        calls.sort(key=lambda c: c["seq"])
        return [c for c in calls if name is None or c["node"] == name]

    def env_for(self, name: str) -> dict[str, str]:
        own, stubs = self.root / "hw" / name / "bin", self.root / "bin"
        return {"HOME": str(self.login_home(name)), "PATH": f"{own}:{stubs}:/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8", "STUB_NODE": name, "STUB_ROOT": str(self.root),
                "SPARKCTL_SYSFS_ROOT": str(self.root / "hw" / name / "infiniband")}

    def docker(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the stub docker on node `name` directly (to set a scene: `docker pull IMAGE`)."""
        return subprocess.run(["docker", *args], env=self.env_for(name), capture_output=True, text=True,
                              timeout=30, check=False)

    def texts(self) -> list[str]:
        """Everything that crossed to a node: command strings and what was sent on stdin/SFTP."""
        with self.lock:
            return [s.command + "\n" + s.stdin.decode("utf-8", "replace") for s in self.sent]


class _Channel:
    """The part of paramiko.Channel sparkctl uses, backed by a local `sh -c`."""

    def __init__(self, nodes: LocalNodes, name: str) -> None:
        self.nodes, self.name = nodes, name
        self.proc: subprocess.Popen[bytes] | None = None
        self.out, self.err = bytearray(), bytearray()
        self.combine = False
        self.closed = False
        self._cv = threading.Condition()
        self._readers: list[threading.Thread] = []
        self._rfd, self._wfd = os.pipe()
        self._fd_lock = threading.Lock()  # no poke after close: a closed fd number is soon another's
        self._sent: Sent | None = None
        self.status_event = threading.Event()  # paramiko's: set once the exit status is in
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)  # a full pipe is already "readable": drop the poke

    # -- select() support: the pipe is readable whenever there may be something to read
    def fileno(self) -> int:
        return self._rfd

    def _poke(self) -> None:
        with self._fd_lock:
            if self._wfd < 0:
                return
            try:
                os.write(self._wfd, b"x")
            except OSError:
                pass

    def settimeout(self, t: float | None) -> None:
        pass

    def set_combine_stderr(self, on: bool) -> None:
        self.combine = on

    def exec_command(self, command: str) -> None:
        self._sent = Sent(self.name, command)
        with self.nodes.lock:
            self.nodes.sent.append(self._sent)
        home = self.nodes.login_home(self.name)
        self.proc = subprocess.Popen(["sh", "-c", command], cwd=home, env=self.nodes.env_for(self.name),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        for stream, err in ((self.proc.stdout, False), (self.proc.stderr, True)):
            t = threading.Thread(target=self._read, args=(stream, err), daemon=True)
            t.start()
            self._readers.append(t)
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        assert self.proc is not None
        self.proc.wait()
        for t in self._readers:
            t.join()
        self.status_event.set()
        self._poke()

    def _read(self, stream: Any, err: bool) -> None:
        while True:
            try:
                chunk = stream.read1(65536)
            except (ValueError, OSError):  # closed under us by close(): the channel is gone
                chunk = b""
            with self._cv:
                if not chunk:
                    break
                (self.out if (not err or self.combine) else self.err).extend(chunk)
            self._poke()
        self._poke()

    # -- stdin
    def send_ready(self) -> bool:
        return True

    def send(self, data: bytes) -> int:
        assert self.proc is not None and self.proc.stdin is not None and self._sent is not None
        self._sent.stdin.extend(data)
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass
        return len(data)

    def sendall(self, data: bytes) -> None:
        self.send(data)

    def shutdown_write(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    # -- output
    def _take(self, buf: bytearray, n: int) -> bytes:
        with self._cv:
            data = bytes(buf[:n])
            del buf[:n]
        return data

    def _drain(self) -> None:
        with self._fd_lock:
            if self._rfd < 0:
                return
            try:
                while os.read(self._rfd, 4096):
                    pass
            except OSError:
                pass

    def recv_ready(self) -> bool:
        self._drain()  # before looking: a poke that comes after this leaves the pipe readable again
        return bool(self.out)

    def recv(self, n: int) -> bytes:
        return self._take(self.out, n)

    def recv_stderr_ready(self) -> bool:
        self._drain()
        return bool(self.err)

    def recv_stderr(self, n: int) -> bytes:
        return self._take(self.err, n)

    @property
    def eof_received(self) -> bool:
        return all(not t.is_alive() for t in self._readers)

    def exit_status_ready(self) -> bool:
        return self.status_event.is_set()

    def recv_exit_status(self) -> int:
        assert self.proc is not None
        code = self.proc.wait(60)
        for t in self._readers:
            t.join(10)
        return code

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr) if self.proc else ():
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        with self._fd_lock:
            for fd in (self._rfd, self._wfd):
                os.close(fd)
            self._rfd = self._wfd = -1


class _SftpFile:
    def __init__(self, nodes: LocalNodes, name: str, path: Path) -> None:
        self.nodes, self.name, self.path = nodes, name, path
        self.fh = open(path, "wb")  # noqa: SIM115 - closed in __exit__

    def __enter__(self) -> _SftpFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.fh.close()

    def chmod(self, mode: int) -> None:
        os.chmod(self.path, mode)

    def write(self, data: bytes) -> None:
        sent = Sent(self.name, f"<sftp write {self.path.name}>", bytearray(data))
        with self.nodes.lock:
            self.nodes.sent.append(sent)
        self.fh.write(data)


class _Sftp:
    def __init__(self, nodes: LocalNodes, name: str) -> None:
        self.nodes, self.name = nodes, name

    def _path(self, p: str) -> Path:
        return self.nodes.login_home(self.name) / p  # relative to the home, as SFTP is; absolute stays absolute

    def open(self, path: str, mode: str) -> _SftpFile:
        return _SftpFile(self.nodes, self.name, self._path(path))

    def posix_rename(self, a: str, b: str) -> None:
        os.replace(self._path(a), self._path(b))

    def close(self) -> None:
        pass


class _Transport:
    def __init__(self, nodes: LocalNodes, name: str) -> None:
        self.nodes, self.name = nodes, name

    def open_session(self, timeout: float | None = None) -> _Channel:
        return _Channel(self.nodes, self.name)

    def open_sftp_client(self) -> _Sftp:
        return _Sftp(self.nodes, self.name)

    def close(self) -> None:
        pass


def _hardware(where: Path, index: int) -> None:
    """The lab's seams for host `index` (sysfs tree, nvidia-smi) and an `ip -j addr` that shows its
    fabric port with its address: what the probe needs to find the pins."""
    from sparkctl.lab.seams import write_nvidia_smi, write_sysfs
    from sparkctl.lab.state import PORT_IFS, HostSpec

    spec = HostSpec.of(index)
    macs = {ifname: f"02:00:00:00:{index:02x}:{p:02x}" for p, ifname in enumerate(PORT_IFS)}
    write_sysfs(where / "infiniband", spec, macs, {spec.fabric_if: True})
    (where / "bin").mkdir(parents=True, exist_ok=True)
    write_nvidia_smi(where / "bin", spec)
    links = [{"ifindex": 1, "ifname": "lo", "flags": ["LOOPBACK", "UP"], "operstate": "UNKNOWN",
              "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]}]
    for p, ifname in enumerate(PORT_IFS):
        on = ifname == spec.fabric_if
        links.append({"ifindex": 2 + p, "ifname": ifname, "flags": ["BROADCAST", "UP", "LOWER_UP"] if on else ["BROADCAST"],
                      "operstate": "UP" if on else "DOWN", "address": macs[ifname],
                      "addr_info": [{"family": "inet", "local": spec.fabric_ip, "prefixlen": 24}] if on else []})
    ip = where / "bin" / "ip"
    ip.write_text("#!/bin/sh\ncat <<'EOF'\n" + json.dumps(links) + "\nEOF\n")
    ip.chmod(0o755)


@contextmanager
def local_nodes(monkeypatch: pytest.MonkeyPatch, root: Path, names: list[str]) -> Iterator[LocalNodes]:
    """Patch sparkctl.cluster so that nodes `names` are local folders under root/nodes/."""
    from sparkctl.cluster import fanout  # Cluster.connect calls fanout.connect: patched where it is used
    from sparkctl.remote import lockdir as lock

    nodes = LocalNodes(root, list(names))
    monkeypatch.setattr(lock, "LOCK_ROOT", MACHINE_TMP)  # in-process runs have it from conftest; a subprocess not
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    docker = bin_dir / "docker"
    docker.write_text(f"#!{sys.executable} -S\n" + STUB_DOCKER.read_text())
    docker.chmod(0o755)
    ssh_config = root / "ssh_config"
    ssh_config.write_text("".join(f"Host {n}\n  HostName 127.0.0.1\n  User root\n" for n in names))
    for i, n in enumerate(names, start=1):
        nodes.home(n).mkdir(parents=True, exist_ok=True)
        (nodes.home(n) / MACHINE_TMP).mkdir(exist_ok=True)
        (nodes.home(n) / MACHINE_TMP).chmod(0o1777)  # as /var/tmp is
        _hardware(root / "hw" / n, i)
    monkeypatch.setattr(fanout, "connect", lambda target, **kw: _Transport(nodes, target.alias))
    monkeypatch.setenv("SPARKCTL_SSH_CONFIG", str(ssh_config))
    # Local nodes are this machine: its page cache is never dropped (DROP_CACHES would, as root), and
    # `up` does not judge its memory (a verdict that would follow the machine's load; the lab's memory
    # tests do that on purpose).
    monkeypatch.setenv("DROP_CACHES", "0")
    monkeypatch.setenv("MEMORY_WAIT_S", "0")
    # Every node holds the lab recipe's base (the same image everywhere, as `lab up` leaves it), so
    # `build` pins it without pulling or shipping; the calls that set this scene are not recorded.
    for n in names:
        nodes.docker(n, "pull", "sparkctl-lab/engine:latest")
    (root / "docker-calls.jsonl").unlink(missing_ok=True)
    yield nodes


@contextmanager
def served_scene(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, nodes: list[str], env: dict[str, str],
                 unset: tuple[str, ...] = ("SPARKCTL_ENV_FILE", "TP", "DCP", "VLLM_API_KEY")) -> Iterator[LocalNodes]:
    """The scene the offline lifecycle tests start from: the working directory is tmp_path, a small
    checkpoint with the lab's serving chain, the cluster's settings in the environment (`unset` removed
    first, then NODES, MODEL, RECIPE=lab, CLUSTER_NAME=t, FABRIC_SUBNET, and `env` over them), and
    local nodes whose engines already hold the chain's last image."""
    from tests.conftest import write_model, write_serving

    monkeypatch.chdir(tmp_path)
    model = write_model(tmp_path / "model", 1_000_000, 2)
    write_serving(model)
    for k in unset:
        monkeypatch.delenv(k, raising=False)
    settings = {"NODES": " ".join(nodes), "MODEL": str(model), "RECIPE": "lab", "CLUSTER_NAME": "t",
                "FABRIC_SUBNET": "10.232.0.0/24", **env}
    for k, v in settings.items():
        monkeypatch.setenv(k, v)
    with local_nodes(monkeypatch, tmp_path / "lab", nodes) as ln:
        for n in nodes:
            ln.docker(n, "pull", "sparkctl-lab/chain:keys3")
        yield ln
