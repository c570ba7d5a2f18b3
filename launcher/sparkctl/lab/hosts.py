"""One lab host's processes: its mount namespace, sshd, containerd and dockerd, and their teardown.

Every daemon of host sparkN runs inside netns sparkN *and* the host's own mount namespace, entered
with `nsenter --net=... --mount=...` (not `ip netns exec`, which remounts /sys and leaves dockerd
without its cgroup mounts). In that mount namespace (propagation private, so nothing leaks between
hosts or back to the machine) the host's own folders are bound over two paths:
    <host>/models -> /models/lab   (the "shared" model path; an NFS mistake = one host's folder differs)
    <host>/home   -> /root         (so SSH sessions read this host's dotfiles, not the machine's)
sshd, containerd, dockerd and hence every container of that host see those folders.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from docker.errors import DockerException

from ..errors import CheckFailed
from . import engines
from .proc import alive, out, read_pid, run, say, stop_pid, wait_for
from .seams import CONTAINER_SYSFS
from .state import MODEL_PATH, NS_DIR, HostPaths, HostSpec

SSHD = "/usr/sbin/sshd"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# ------------------------------------------------------------------------------------------- mounts
def mountpoints() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4].replace("\\040", " ") for line in f}


def ensure_ns_dir() -> None:
    """The folder holding mount-namespace files must itself be a private mount, or binding fails."""
    NS_DIR.mkdir(parents=True, exist_ok=True)
    if str(NS_DIR) not in mountpoints():
        run(["mount", "--bind", str(NS_DIR), str(NS_DIR)])
    run(["mount", "--make-private", str(NS_DIR)])


def release_ns_dir() -> None:
    if str(NS_DIR) in mountpoints() and not any(NS_DIR.iterdir()):
        run(["umount", str(NS_DIR)], check=False)


def mntns_ok(paths: HostPaths) -> bool:
    """The host's mount namespace exists and has its own folders at /models/lab, the sysfs seam and /var/tmp."""
    if not {str(paths.mntns), str(paths.utsns), str(paths.ipcns)} <= mountpoints():
        return False
    got = out(["nsenter", f"--mount={paths.mntns}", "--", "stat", "-c", "%d:%i", MODEL_PATH, CONTAINER_SYSFS,
               "/var/tmp"], check=False).split()
    paths.sysfs.mkdir(parents=True, exist_ok=True)
    _own_var_tmp(paths)
    want = [os.stat(p) for p in (paths.models, paths.sysfs, paths.var_tmp)]
    return got == [f"{w.st_dev}:{w.st_ino}" for w in want]


def _own_var_tmp(paths: HostPaths) -> None:
    """The host's /var/tmp, as Linux makes it: sticky and world-writable."""
    paths.var_tmp.mkdir(parents=True, exist_ok=True)
    paths.var_tmp.chmod(0o1777)


def create_mntns(paths: HostPaths) -> None:
    Path(MODEL_PATH).mkdir(parents=True, exist_ok=True)
    Path(CONTAINER_SYSFS).mkdir(parents=True, exist_ok=True)
    paths.sysfs.mkdir(parents=True, exist_ok=True)
    _own_var_tmp(paths)
    if str(paths.utsns) not in mountpoints():  # its own hostname too (logs and prompts say sparkN)
        paths.utsns.touch()
        run(["unshare", f"--uts={paths.utsns}", "--", "hostname", paths.root.name], where=paths.root.name)
    # Its own IPC namespace and /dev/shm: two machines never share shared memory. vLLM tells ranks on one
    # node from ranks on others by opening a shared-memory segment (`in_the_same_node_as`); with one
    # /dev/shm for every host, a headless worker on another host was taken for a local one.
    if str(paths.ipcns) not in mountpoints():
        paths.ipcns.touch()
        run(["unshare", f"--ipc={paths.ipcns}", "--", "true"], where=paths.root.name)
    paths.mntns.touch()
    # Each host is its own machine: its own /etc/machine-id (sparkctl tells machines apart by it).
    machine_id = paths.root / "machine-id"
    if not machine_id.exists():
        machine_id.write_text(os.urandom(16).hex() + "\n")
    # unshare persists the namespace by binding it onto paths.mntns; the mounts run inside it.
    script = (
        f"mount --bind {shlex.quote(str(paths.models))} {shlex.quote(MODEL_PATH)} && "
        f"mount --bind {shlex.quote(str(paths.home))} /root && "
        f"mount --bind {shlex.quote(str(paths.sysfs))} {shlex.quote(CONTAINER_SYSFS)} && "
        f"mount --bind {shlex.quote(str(machine_id))} /etc/machine-id && "
        # Its own /var/tmp: the cluster lock lives there, one per machine (with one for every host,
        # a command's lock on its second host would meet its own lock on the first).
        f"mount --bind {shlex.quote(str(paths.var_tmp))} /var/tmp && "
        "mount -t tmpfs -o mode=1777,nosuid,nodev sparkctl-lab-shm /dev/shm"
    )
    run(["unshare", f"--mount={paths.mntns}", "--propagation", "private", "--", "sh", "-c", script],
        where=paths.root.name)


def bind_in_host(paths: HostPaths, source: Path, target: str) -> None:
    """Bind `source` at `target` inside the host's mount namespace (once: a bind already there is kept).
    The namespace shares this machine's / privately, so the mount point is made here first."""
    Path(target).mkdir(parents=True, exist_ok=True)
    want = os.stat(source)
    got = out(["nsenter", f"--mount={paths.mntns}", "--", "stat", "-c", "%d:%i", target], check=False).strip()
    if got == f"{want.st_dev}:{want.st_ino}":
        return
    run(["nsenter", f"--mount={paths.mntns}", "--", "mount", "--bind", str(source), target], where=paths.root.name)


def drop_mntns(paths: HostPaths) -> None:
    for nsfile in (paths.mntns, paths.utsns, paths.ipcns):
        if str(nsfile) in mountpoints():
            run(["umount", str(nsfile)], check=False)
        nsfile.unlink(missing_ok=True)


def in_host(paths: HostPaths) -> list[str]:
    """argv prefix that runs a command inside the host's network, mount and UTS namespaces."""
    return ["nsenter", f"--net={paths.netns}", f"--mount={paths.mntns}", f"--uts={paths.utsns}",
            f"--ipc={paths.ipcns}", "--"]


# ------------------------------------------------------------------------------------------- sshd
def sshd_config_text(paths: HostPaths) -> str:
    env = {
        "PATH": f"{paths.bin_dir}:{SYSTEM_PATH}",
        "DOCKER_HOST": paths.docker_host,
        "SPARKCTL_SYSFS_ROOT": str(paths.sysfs),
        "SPARKCTL_KERNEL_SEAM": str(paths.kernel_seam),
        "SPARKCTL_SETUP_ROOT": str(paths.setup_root),
        "SPARKCTL_NETPLAN_APPLY": str(paths.bin_dir / "netplan-apply"),
    }
    setenv = " ".join(f'"{k}={v}"' for k, v in env.items())
    return f"""# sshd of lab host {paths.root.name} (written by `sparkctl lab up`; runs in its netns + mount ns)
Port 22
ListenAddress 0.0.0.0
HostKey {paths.host_key}
PidFile {paths.sshd_pid}
# The lab client's key, and the user's own file (`model sync` adds the head's sync key there).
AuthorizedKeysFile {paths.authorized_keys} .ssh/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitUserEnvironment no
UseDNS no
PrintMotd no
PrintLastLog no
# INFO logs one "Accepted publickey" line per connection (benchmarks count them).
LogLevel INFO
SyslogFacility AUTH
# Benchmarks open many sessions at once.
MaxStartups 200
MaxSessions 100
Subsystem sftp internal-sftp
# Every session, interactive or `ssh host cmd`, gets the host's seams and its own Docker engine.
SetEnv {setenv}
"""


def write_home(paths: HostPaths) -> None:
    """The host's /root: login shells reset PATH in /etc/profile, so .profile puts the seams back first."""
    paths.home.mkdir(parents=True, exist_ok=True)
    paths.home.chmod(0o700)
    lines = (
        f'export PATH="{paths.bin_dir}:{SYSTEM_PATH}"\n'
        f'export DOCKER_HOST="{paths.docker_host}"\n'
        f'export SPARKCTL_SYSFS_ROOT="{paths.sysfs}"\n'
        f'export SPARKCTL_KERNEL_SEAM="{paths.kernel_seam}"\n'
    )
    (paths.home / ".profile").write_text("# lab host " + paths.root.name + "\n" + lines)
    (paths.home / ".bashrc").write_text("# lab host " + paths.root.name + ": nothing from the machine's ~/.bashrc\n")


def write_sshd(paths: HostPaths, client_pub: str) -> None:
    paths.ssh_dir.mkdir(parents=True, exist_ok=True)
    paths.ssh_dir.chmod(0o700)
    if not paths.host_key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{paths.root.name}", "-f", str(paths.host_key)])
    paths.authorized_keys.write_text(client_pub.strip() + "\n")
    paths.authorized_keys.chmod(0o600)
    paths.sshd_config.write_text(sshd_config_text(paths))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
    run([SSHD, "-t", "-f", str(paths.sshd_config)], where=paths.root.name)


def sshd_ok(paths: HostPaths) -> bool:
    pid = read_pid(paths.sshd_pid)
    return alive(pid) and same_ns(pid, "net", paths.netns)


def start_sshd(paths: HostPaths, spec: HostSpec) -> None:
    stop_pid(read_pid(paths.sshd_pid))
    for pid in pids_in_host(paths):  # a listener whose pid file was lost (crash) still holds port 22
        if str(paths.sshd_config).encode() in _cmdline(pid):
            stop_pid(pid, timeout=5)
    paths.sshd_pid.unlink(missing_ok=True)
    paths.run.mkdir(parents=True, exist_ok=True)
    run(in_host(paths) + [SSHD, "-f", str(paths.sshd_config), "-E", str(paths.sshd_log)], where=spec.name)
    wait_for(f"{spec.name}: sshd on {spec.mgmt_ip}:22", lambda: port_open(spec.mgmt_ip, 22), timeout=15)


def port_open(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- docker
def containerd_toml(paths: HostPaths) -> str:
    return f"""# containerd of lab host {paths.root.name}: its own root, state and sockets
version = 2
root = "{paths.containerd_data}"
state = "{paths.containerd_state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{paths.containerd_sock}"
[ttrpc]
  address = "{paths.containerd_sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{paths.containerd_data}/opt"
"""


def dockerd_argv(paths: HostPaths) -> list[str]:
    return [
        "dockerd",
        f"--data-root={paths.docker_data}",
        f"--exec-root={paths.docker_exec}",
        f"--pidfile={paths.docker_pid}",
        f"--host={paths.docker_host}",
        f"--containerd={paths.containerd_sock}",
        f"--config-file={paths.daemon_json}",
        "--bridge=none",
        "--iptables=false",
        "--ip-masq=false",
        "--ip-forward=false",
        "--userland-proxy=false",
        "--storage-driver=overlay2",
        "--log-level=warn",
    ]


def docker_ok(paths: HostPaths) -> bool:
    if not alive(read_pid(paths.docker_pid)):
        return False
    return engines.data_root(paths) == str(paths.docker_data)  # this host's own engine, answering


def _spawn(argv: list[str], log: Path) -> int:
    with open(log, "ab") as f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    return proc.pid


def start_docker(paths: HostPaths, spec: HostSpec) -> None:
    stop_docker(paths)
    for p in (paths.docker_data, paths.containerd_data, paths.run):
        p.mkdir(parents=True, exist_ok=True)
    paths.containerd_toml.write_text(containerd_toml(paths))
    paths.daemon_json.write_text("{}\n")
    pid = _spawn(in_host(paths) + ["containerd", f"--config={paths.containerd_toml}"], paths.containerd_log)
    paths.containerd_pid.write_text(f"{pid}\n")
    wait_for(f"{spec.name}: containerd socket", lambda: paths.containerd_sock.exists() or not alive(pid), timeout=30)
    if not alive(pid):
        raise CheckFailed(f"{spec.name}: containerd exited at start; see {paths.containerd_log}")
    _spawn(in_host(paths) + dockerd_argv(paths), paths.dockerd_log)
    try:
        wait_for(f"{spec.name}: dockerd on {paths.docker_sock}", lambda: docker_ok(paths), timeout=60, interval=0.5)
    except CheckFailed:
        tail = paths.dockerd_log.read_text(errors="replace")[-600:] if paths.dockerd_log.exists() else ""
        raise CheckFailed(f"{spec.name}: dockerd did not come up; end of {paths.dockerd_log}:\n{tail}") from None


def stop_docker(paths: HostPaths) -> None:
    """Remove the engine's containers (so no shim outlives it), then stop dockerd and containerd."""
    if docker_ok(paths):
        try:
            engines.remove_all_containers(paths)
        except DockerException as exc:  # stopping the engine below removes them anyway
            say(f"lab: {paths.root.name}: could not remove its containers first: {exc}")
    stop_pid(read_pid(paths.docker_pid), timeout=20)
    stop_pid(read_pid(paths.containerd_pid), timeout=10)
    for p in (paths.docker_pid, paths.containerd_pid, paths.docker_sock):
        p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- processes
def ns_inode(path: Path | str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def same_ns(pid: int | None, kind: str, nsfile: Path) -> bool:
    want = ns_inode(nsfile)
    return pid is not None and want is not None and ns_inode(f"/proc/{pid}/ns/{kind}") == want


def pids_in_host(paths: HostPaths) -> list[int]:
    """Processes living in the host's netns or mount ns: what is left of it after the daemons stop
    (SSH sessions, shims, containers on --network host)."""
    net, mnt = ns_inode(paths.netns), ns_inode(paths.mntns)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        if (net and ns_inode(f"/proc/{entry}/ns/net") == net) or (mnt and ns_inode(f"/proc/{entry}/ns/mnt") == mnt):
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def teardown_processes(paths: HostPaths, *, remove_run: bool = False) -> None:
    stop_docker(paths)
    stop_pid(read_pid(paths.sshd_pid), timeout=5)
    paths.sshd_pid.unlink(missing_ok=True)
    for pid in pids_in_host(paths):
        stop_pid(pid, timeout=5)
    drop_mntns(paths)
    if remove_run and paths.run.exists():
        shutil.rmtree(paths.run, ignore_errors=True)


def docker_cli(paths: HostPaths, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return run(["docker", "-H", paths.docker_host, *args], timeout=timeout, where=paths.root.name)


def has_image(paths: HostPaths, ref: str) -> bool:
    return engines.image_attrs(paths, ref) is not None


def set_port_mtu(paths: HostPaths, ifname: str, mtu: int) -> None:
    """A lab host's fabric port at another MTU (1500 beside the others' 9000: what `check`'s parity row
    fails); set it back to the lab's own with the value `ip -j link` showed before."""
    run([*in_host(paths), "ip", "link", "set", "dev", ifname, "mtu", str(int(mtu))], where=paths.root.name)
