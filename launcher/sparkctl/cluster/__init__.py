"""Cluster access: one verified SSH connection per node, opened in parallel, reused for everything.

Every sparkctl command that touches nodes goes through here:

    with Cluster(["spark1", "spark2"], ssh_config) as cluster:
        results = cluster.run_all(["uname", "-m"])          # Results: {node: RunResult | NodeError}
        results.raise_if_failed("uname")                    # or read results.ok / results.failed
        version = cluster.node("spark1").docker_json(["version", "--format", "{{json .}}"])

- A node name is an SSH alias, resolved exactly as OpenSSH resolves it (`ssh -G`: Include, Match,
  ProxyJump, ProxyCommand, IdentityFile, CertificateFile, UserKnownHostsFile, HostKeyAlias, HashKnownHosts...).
- Each node gets ONE SSH transport per Cluster; every command, file upload (SFTP), stream and docker
  CLI call is a channel on it. (Benchmarks count sshd's "Accepted publickey" lines: N nodes, N lines.)
- Host keys are verified against known_hosts (host certificates against its @cert-authority lines). An unknown, changed or revoked key fails that node
  with the key type, the SHA256 fingerprint and the command that trusts it (`sparkctl trust NODE`).
  Nothing here accepts a key silently; there is no switch to turn that off.
- argv is joined with shlex.join, so every value is one quoted word on the remote shell: a value
  like `$(touch /tmp/x)` or `;rm -rf /` is data.
- A node that fails (cannot connect, times out, dies mid-command) becomes a NodeError with a human
  reason and a fix; the other nodes carry on (Fabric's GroupResult idea: nothing is lost).

The package, by seam (each module imports only those above it):

    (NodeError, the one failure type, is in sparkctl.errors: pure rules name it too)
    sshconfig.py   an alias -> SshTarget, via `ssh -G`
    certs.py       OpenSSH certificates: read, and a host's checked as ssh checks it
    hostkeys.py    the known_hosts policy: judge, explain, record (`trust`)
    proxycommand.py  a ProxyCommand run as ssh runs it, its pipes as the transport's socket
    transport.py   TCP / ProxyJump hops / ProxyCommand, handshake, host key check, authentication
    channel.py     Node: run, start (Session), open_stream (Stream), SFTP, docker
    fanout.py      Cluster, Results (per-node answers), parallel (a node's jobs side by side)

Import from `sparkctl.cluster`; the modules are the layout, this is the API. Patch a name in the
module that uses it (e.g. `sparkctl.cluster.fanout.connect`, which Cluster.connect calls).
"""

from __future__ import annotations

from ..errors import NodeError
from .channel import (
    DEFAULT_COMMAND_TIMEOUT,
    MAX_OUTPUT_BYTES,
    Node,
    NodeResult,
    RunResult,
    Session,
    Stream,
    StreamLost,
    docker_json,
    remote_command,
)
from .fanout import Cluster, Results, parallel, raise_failed
from .hostkeys import (
    HostKeyVerdict,
    KnownHost,
    fingerprint,
    hash_hostname,
    host_key_error,
    host_matches,
    judge_host_key,
    no_known_hosts_file,
    read_known_hosts,
    record_host_key,
)
from .sshconfig import (
    DEFAULT_SSH_CONFIG,
    SSH_G_TIMEOUT,
    SshConfig,
    SshTarget,
    load_ssh_config,
    resolve_target,
    ssh_g,
)
from .transport import DEFAULT_CONNECT_TIMEOUT, Jumps, fetch_host_key, open_transport

__all__ = [
    "DEFAULT_COMMAND_TIMEOUT", "DEFAULT_CONNECT_TIMEOUT", "DEFAULT_SSH_CONFIG", "MAX_OUTPUT_BYTES", "SSH_G_TIMEOUT",
    "Cluster", "HostKeyVerdict", "Jumps", "KnownHost", "Node", "NodeError", "NodeResult", "Results", "RunResult",
    "Session", "SshConfig", "SshTarget", "Stream", "StreamLost", "docker_json", "fetch_host_key",
    "fingerprint", "hash_hostname", "host_key_error", "host_matches", "judge_host_key", "load_ssh_config",
    "no_known_hosts_file", "open_transport", "parallel", "raise_failed", "read_known_hosts", "record_host_key",
    "remote_command", "resolve_target", "ssh_g",
]
