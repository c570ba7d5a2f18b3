"""`lab up`, `lab status`, `lab down`: build, inspect and remove the whole lab.

`up` is a sequence of ensure-steps, each of which first looks at what is there: a healthy lab is
reused in seconds, a half-dead one (after a crash: stale netns, pid files, sockets) has only its
broken parts rebuilt. The network is set up host by host (cheap `ip` calls); the rest runs per host
in parallel while the base image tarball is built (first time only) in the background.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckFailed, UsageError
from . import fresh as fresh_mod
from . import hosts, image, net, seams
from .proc import ok, out, run, say
from .state import (
    BASE_IMAGE,
    ENGINE_IMAGE,
    FABRIC_NET,
    MAX_NODES,
    MGMT_NET,
    MODEL_PATH,
    NS_DIR,
    PORT_IFS,
    RUN_DIR,
    VLLM_IMAGE,
    VLLM_MODEL_PATH,
    HostPaths,
    HostSpec,
    LabFiles,
    hosts_for,
    lab_dir,
)

COPY_STAMP = ".sparkctl-lab-copy"  # in a host's model folder: the copy finished
# One lab per machine, used by several people and test sessions: `up` and `down` take turns.
# (The lock file stays: removing a lock file others may be waiting on would break the lock.)
LOCK_FILE = Path("/run/lock/sparkctl-lab.lock")


@contextmanager
def exclusive(what: str, timeout: float = 900) -> Iterator[None]:
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "a") as fd:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    say(f"lab: another `sparkctl lab up/down` is running; {what} waits (up to {timeout:.0f}s)")
                    told = True
                if time.monotonic() > deadline:
                    raise CheckFailed(f"lab {what}: {LOCK_FILE} stayed locked for {timeout:.0f}s",
                                      fix="wait for the other `sparkctl lab` command to finish") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


@dataclass
class HostStatus:
    name: str
    mgmt_ip: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# ------------------------------------------------------------------------------------------- state file
def read_state(files: LabFiles) -> dict[str, Any]:
    try:
        return json.loads(files.state_json.read_text())
    except (OSError, ValueError):
        return {}


def write_state(files: LabFiles, state: dict[str, Any]) -> None:
    tmp = files.state_json.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.rename(files.state_json)


# ------------------------------------------------------------------------------------------- client files
def ensure_client_key(files: LabFiles) -> str:
    if not files.client_key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sparkctl-lab-client", "-f", str(files.client_key)])
    return Path(f"{files.client_key}.pub").read_text()


def write_client_files(files: LabFiles, specs: list[HostSpec], tp: int | None = None) -> None:
    cfg = ["# The lab's hosts (written by `sparkctl lab up`). Host keys are checked against known_hosts."]
    known = []
    for spec in specs:
        paths = HostPaths.of(spec.name, files.root)
        cfg += [
            f"Host {spec.name}",
            f"  HostName {spec.mgmt_ip}",
            "  User root",
            "  Port 22",
            f"  IdentityFile {files.client_key}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {files.known_hosts}",
            "  StrictHostKeyChecking yes",
            "  BatchMode yes",
            "  ConnectTimeout 10",
            "",
        ]
        key = " ".join(Path(f"{paths.host_key}.pub").read_text().split()[:2])
        known.append(f"{spec.name},{spec.mgmt_ip} {key}")
    files.ssh_config.write_text("\n".join(cfg))
    files.known_hosts.write_text("\n".join(known) + "\n")
    names = " ".join(s.name for s in specs)
    # TP: the DGX Spark shape, 4 hosts per service, where the hosts split into groups of 4 (8 hosts are
    # 2 replicas, 16 are 4); else one service over every host. DCP is the recipe's 4 where it divides
    # TP, else the largest of 2 and 1 that does, so the file is a valid cluster input for any count.
    tp = tp or lab_tp(len(specs))
    if len(specs) % tp:
        raise UsageError(f"--tp {tp}: {len(specs)} hosts do not split into groups of {tp}",
                         fix=f"choose a --tp that divides {len(specs)}")
    dcp = next(d for d in (4, 2, 1) if tp % d == 0)
    files.env_file.write_text(
        "# The lab cluster (written by `sparkctl lab up`). Use: sparkctl --env-file THIS --ssh-config "
        f"{files.ssh_config} check\n"
        f'NODES="{names}"\n'
        f"MODEL={MODEL_PATH}\n"
        "RECIPE=lab\n"
        f"TP={tp}\n"
        f"DCP={dcp}\n"
        f"FABRIC_SUBNET={FABRIC_NET}\n"
        "# The hosts share this machine's one page cache: a lab `up` does not drop it for everyone (the\n"
        "# memory tests turn it on themselves). A GB10 cluster drops it by default (DROP_CACHES=auto).\n"
        "DROP_CACHES=0\n"
    )


def lab_tp(nodes: int) -> int:
    """The lab's default TP for `nodes` hosts (see write_client_files)."""
    return 4 if nodes % 4 == 0 else nodes


def print_paths(files: LabFiles, engine: str = "standin") -> None:
    """The two lines scripts read from stdout (everything else goes to stderr)."""
    print(f"SPARKCTL_SSH_CONFIG={files.ssh_config}", flush=True)
    print(f"SPARKCTL_ENV_FILE={files.vllm_env_file if engine == 'vllm' else files.env_file}", flush=True)


# ------------------------------------------------------------------------------------------- checkpoint
def ensure_checkpoint(files: LabFiles, source: Path | None) -> Path:
    """The lab's test checkpoint (sparkctl.lab.ckptgen's "tiny" pack), or a given folder copied as is."""
    if source is not None:
        if not (source / "config.json").exists():
            raise UsageError(f"--checkpoint {source}: no config.json there", fix="point it at a model folder")
        return source
    done = files.checkpoint / COPY_STAMP
    if done.exists():
        return files.checkpoint
    try:
        from . import ckptgen
    except ImportError as exc:
        raise CheckFailed(f"lab: sparkctl.lab.ckptgen is not available ({exc})",
                          fix="pass --checkpoint DIR with a model folder") from None
    if files.checkpoint.exists():
        shutil.rmtree(files.checkpoint)
    ckptgen.make_checkpoint(files.checkpoint, "tiny")
    done.write_text("complete\n")
    return files.checkpoint


def ensure_models(paths: HostPaths, checkpoint: Path) -> None:
    """A plain copy per host (not hardlinks): tests edit one host's folder to simulate an NFS mistake."""
    if (paths.models / COPY_STAMP).exists():
        return
    paths.models.mkdir(parents=True, exist_ok=True)
    for child in paths.models.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    run(["cp", "-a", "--reflink=auto", f"{checkpoint}/.", str(paths.models)], timeout=300)
    (paths.models / COPY_STAMP).write_text("complete\n")


# ------------------------------------------------------------------------------------------- up
def _require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError("the lab needs root (network namespaces, mounts, sshd and dockerd per host)",
                         fix="run it as root: sudo sparkctl lab up")
    for tool in ("ip", "iptables", "sshd", "dockerd", "containerd", "docker", "nsenter", "unshare", "debootstrap"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise UsageError(f"the lab needs `{tool}`, which is not installed",
                             fix="apt-get install -y docker.io openssh-server iproute2 iptables debootstrap")


def _prepare_host_files(files: LabFiles, spec: HostSpec, client_pub: str) -> HostPaths:
    paths = HostPaths.of(spec.name, files.root)
    for p in (paths.root, paths.run, paths.models):
        p.mkdir(parents=True, exist_ok=True)
    hosts.write_home(paths)
    hosts.write_sshd(paths, client_pub)
    seams.write_nvidia_smi(paths.bin_dir, spec)
    seams.write_setup_seams(paths)
    macs = {ifname: net.iface_mac(spec, ifname) for ifname in PORT_IFS}
    up = {ifname: net.iface_up(spec, ifname) for ifname in PORT_IFS}
    seams.write_sysfs(paths.sysfs, spec, macs, up)
    return paths


def _bring_up_host(files: LabFiles, spec: HostSpec, checkpoint: Path, base: Future[Path]) -> float:
    t0 = time.monotonic()
    paths = HostPaths.of(spec.name, files.root)
    ensure_models(paths, checkpoint)
    if not hosts.mntns_ok(paths):
        hosts.teardown_processes(paths)  # daemons of an old namespace would see the wrong folders
        hosts.create_mntns(paths)
    if not hosts.sshd_ok(paths):
        hosts.start_sshd(paths, spec)
    if not hosts.docker_ok(paths):
        hosts.start_docker(paths, spec)
    tarball = base.result(timeout=1200)
    try:
        image.ensure_images(paths, tarball)
    except CheckFailed as exc:
        # An engine whose data-root was damaged (a crash, a `down` racing an `up`) cannot take new
        # layers; its data is only the lab's images, so start it over from an empty data-root.
        say(f"lab: {spec.name}: resetting its Docker data-root ({str(exc).splitlines()[0][:200]})")
        hosts.stop_docker(paths)
        for d in (paths.docker_data, paths.containerd_data):
            shutil.rmtree(d, ignore_errors=True)
        hosts.start_docker(paths, spec)
        image.ensure_images(paths, tarball)
    return time.monotonic() - t0


def up(nodes: int = 4, checkpoint: Path | None = None, tp: int | None = None, engine: str = "standin",
       engine_hosts: list[str] | None = None, fresh: bool = False) -> LabFiles:
    """The lab (`lab up`). engine="vllm" adds the real engine: its checkpoint on every host, its image on
    `engine_hosts` (default: every host; a 2 GB load costs about 75 s per host here, so the real-engine lab
    tests load it only where they run it). fresh: then its hosts as a new owner's nodes are (lab/fresh.py)."""
    _require_root()
    if fresh and engine != "standin":
        raise UsageError("--fresh with --engine vllm: the real-engine lab keeps the lab's own fabric",
                         fix="sparkctl lab up --fresh (the stand-in engine), or --engine vllm without --fresh")
    if not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"--nodes {nodes}: the lab builds 1 to {MAX_NODES} hosts")
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: the lab runs one of {', '.join(ENGINES)}")
    if engine == "vllm" and tp is not None and not 1 <= tp <= nodes:
        raise UsageError(f"--tp {tp}: the real engine's TP group needs {tp} of the lab's {nodes} hosts",
                         fix=f"choose a --tp from 1 to {nodes}, or more --nodes")
    if engine != "vllm" and tp is not None and (tp < 1 or nodes % tp):
        raise UsageError(f"--tp {tp}: {nodes} hosts do not split into groups of {tp}",
                         fix=f"choose a --tp that divides {nodes} (the lab has one GPU per host)")
    with exclusive("up"):
        if engine == "vllm":  # --tp is the real engine's; lab.env (which others use) keeps its default
            files = _up(nodes, checkpoint, None)
            _up_vllm(files, nodes, tp, engine_hosts)
            return files
        files = _up(nodes, checkpoint, tp)
        if fresh:
            fresh_mod.make_fresh([(HostPaths.of(spec.name, files.root), spec) for spec in hosts_for(nodes)])
            state = read_state(files)
            state["fabric"] = "setup"
            write_state(files, state)
            say(f"lab: {nodes} hosts fresh (fabric ports without addresses, nothing of `sparkctl setup`'s): "
                "`sparkctl setup` readies them")
        return files


def _up(nodes: int, checkpoint: Path | None, tp: int | None = None) -> LabFiles:
    files = LabFiles.of()
    t0 = time.monotonic()
    files.root.mkdir(parents=True, exist_ok=True)
    files.root.chmod(0o755)
    files.marker.write_text("sparkctl lab folder: `sparkctl lab down` deletes it\n")
    state = read_state(files)
    old_nodes = int(state.get("nodes", 0))
    if old_nodes > nodes:  # shrinking: remove the extra hosts first
        for spec in hosts_for(old_nodes)[nodes:]:
            _remove_host(files, spec)
    specs = hosts_for(nodes)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=1) as builder:
        base = builder.submit(image.ensure_base_tarball)  # slow only the first time; overlaps the rest
        net.check_no_collision()
        net.ensure_bridges()
        rules = state.get("iptables_rules", []) + net.ensure_forward_rules()
        state.update({"nodes": nodes, "iptables_rules": rules, "mgmt_subnet": str(MGMT_NET),
                      "fabric_subnet": str(FABRIC_NET), "hosts": [s.to_json() for s in specs], "fabric": "lab"})
        write_state(files, state)
        hosts.ensure_ns_dir()
        client_pub = ensure_client_key(files)
        for spec in specs:
            problems = net.host_net_ok(spec)
            if problems:
                if net.netns_exists(spec.name) or (RUN_DIR / spec.name).exists():
                    say(f"lab: {spec.name}: rebuilding its network ({'; '.join(problems)})")
                hosts.teardown_processes(HostPaths.of(spec.name, files.root))
                net.delete_host_net(spec)
                net.create_host_net(spec)
                # what setup wrote there described the network just replaced
                fresh_mod.reset_setup_root(HostPaths.of(spec.name, files.root))
            _prepare_host_files(files, spec, client_pub)
        checkpoint = ensure_checkpoint(files, checkpoint)
        write_client_files(files, specs, tp)
        errors: dict[str, BaseException] = {}
        with ThreadPoolExecutor(max_workers=min(nodes, 8)) as pool:
            futures = {spec.name: pool.submit(_bring_up_host, files, spec, checkpoint, base) for spec in specs}
            for name, fut in futures.items():
                try:
                    took = fut.result(timeout=1500)
                    say(f"lab: {name} ready ({took:.1f}s)")
                except Exception as exc:  # reported per host, like a fan-out should
                    errors[name] = exc
    if errors:
        detail = "\n".join(f"  {name}: {exc}" for name, exc in errors.items())
        raise CheckFailed(f"lab up: {len(errors)} of {nodes} hosts failed:\n{detail}",
                          fix="read the host's logs under " + str(files.root / "hosts") + ", then run `sparkctl lab up` again")
    say(f"lab: {nodes} hosts up in {time.monotonic() - t0:.1f}s")
    return files


# ------------------------------------------------------------------------------------------- --engine vllm
ENGINES = ("standin", "vllm")
MAKE_MODEL = Path(__file__).resolve().parents[3] / "tests" / "realengine" / "make_model.py"
VLLM_SERVING = Path(__file__).resolve().parent / "ckpt_serving_vllm"  # the real checkpoint's serving/ (its chain)


def sync_serving(model_dir: Path) -> None:
    """The real checkpoint's serving/ folder as ckpt_serving_vllm/ has it (rewritten where it differs, so an
    existing lab gets a changed layer without remaking the checkpoint)."""
    dest = model_dir / "serving"
    want = {p.name: p.read_bytes() for p in sorted(VLLM_SERVING.iterdir()) if p.is_file()}
    dest.mkdir(exist_ok=True)
    for old in dest.iterdir():
        if old.is_file() and old.name not in want:
            old.unlink()
    for name, data in want.items():
        f = dest / name
        if not f.is_file() or f.read_bytes() != data:
            f.write_bytes(data)


def ensure_vllm_checkpoint(files: LabFiles, venv: Path) -> Path:
    """The real engine's checkpoint, made once offline by make_model.py in the real-engine venv."""
    done = files.vllm_checkpoint / COPY_STAMP
    if done.exists():
        sync_serving(files.vllm_checkpoint)
        return files.vllm_checkpoint
    if not MAKE_MODEL.is_file():
        raise CheckFailed(f"lab --engine vllm: {MAKE_MODEL} is missing", fix="run it from a sparkctl checkout")
    if files.vllm_checkpoint.exists():
        shutil.rmtree(files.vllm_checkpoint)
    run([str(venv / "bin" / "python"), str(MAKE_MODEL), str(files.vllm_checkpoint)], timeout=600,
        env={"PATH": "/usr/bin:/bin", "HOME": str(files.root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        where="lab --engine vllm checkpoint")
    sync_serving(files.vllm_checkpoint)
    done.write_text("complete\n")
    return files.vllm_checkpoint


def ensure_vllm_models(paths: HostPaths, checkpoint: Path) -> None:
    """The real checkpoint at VLLM_MODEL_PATH inside the host (a copy per host, bound into its namespace)."""
    if not (paths.vllm_models / COPY_STAMP).exists():
        if paths.vllm_models.exists():
            shutil.rmtree(paths.vllm_models)
        run(["cp", "-a", str(checkpoint), str(paths.vllm_models)], timeout=300)
    sync_serving(paths.vllm_models)
    hosts.bind_in_host(paths, paths.vllm_models, VLLM_MODEL_PATH)


def write_vllm_env(files: LabFiles, specs: list[HostSpec], tp: int | None) -> None:
    """One TP group on the first TP hosts (default 2: two real ranks are what 2 CPUs serve at ease)."""
    tp = tp or min(len(specs), 2)
    files.vllm_env_file.write_text(
        "# The lab on the real vLLM for CPU (written by `sparkctl lab up --engine vllm`). Use: sparkctl "
        f"--env-file THIS --ssh-config {files.ssh_config} check\n"
        f'NODES="{" ".join(s.name for s in specs[:tp])}"\n'
        f"MODEL={VLLM_MODEL_PATH}\n"
        "RECIPE=lab-vllm\n"
        f"TP={tp}\n"
        "DCP=1\n"
        f"FABRIC_SUBNET={FABRIC_NET}\n"
        "# The hosts share this machine's one page cache: a lab `up` does not drop it for everyone, as lab.env.\n"
        "DROP_CACHES=0\n"
    )


def _up_vllm(files: LabFiles, nodes: int, tp: int | None, engine_hosts: list[str] | None = None) -> None:
    from . import vllm_image

    t0 = time.monotonic()
    specs = hosts_for(nodes)
    all_paths = [HostPaths.of(s.name, files.root) for s in specs]
    unknown = sorted(set(engine_hosts or []) - {s.name for s in specs})
    if unknown:
        raise UsageError(f"lab --engine vllm: no lab host {', '.join(unknown)} among {nodes}")
    venv = vllm_image.ensure_venv()
    checkpoint = ensure_vllm_checkpoint(files, venv)
    for paths in all_paths:
        ensure_vllm_models(paths, checkpoint)
    on = [p for p in all_paths if engine_hosts is None or p.root.name in engine_hosts]
    took = vllm_image.ensure_vllm(on)
    say("lab: " + ", ".join(f"{name} {VLLM_IMAGE} {t:.1f}s" for name, t in took.items()))
    write_vllm_env(files, specs, tp)
    say(f"lab: the real engine ready on {nodes} hosts in {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------------- status
def host_status(files: LabFiles, spec: HostSpec, deep: bool = True, lab_fabric: bool = True) -> HostStatus:
    """What is wrong with a host; lab_fabric=False (a lab made --fresh): its fabric addresses are setup's."""
    st = HostStatus(spec.name, spec.mgmt_ip)
    paths = HostPaths.of(spec.name, files.root)
    st.problems += net.host_net_ok(spec, lab_fabric=lab_fabric)
    if st.problems:
        return st
    if not hosts.mntns_ok(paths):
        st.problems.append(f"mount namespace with {MODEL_PATH} missing")
    if not (paths.models / COPY_STAMP).exists():
        st.problems.append(f"model folder {paths.models} incomplete")
    if not (paths.bin_dir / "nvidia-smi").exists() or not paths.sysfs.is_dir():
        st.problems.append("hardware seams (nvidia-smi, sysfs tree) missing")
    if not hosts.sshd_ok(paths):
        st.problems.append("sshd not running")
    elif deep and not ok(["ssh", "-F", str(files.ssh_config), spec.name, "true"], timeout=20):
        st.problems.append(f"`ssh -F {files.ssh_config} {spec.name} true` fails")
    if not hosts.docker_ok(paths):
        st.problems.append("dockerd not answering")
    else:
        for ref in (BASE_IMAGE, ENGINE_IMAGE):
            if not hosts.has_image(paths, ref):
                st.problems.append(f"image {ref} missing")
    return st


def status(deep: bool = True) -> tuple[LabFiles, list[HostStatus], dict[str, Any]]:
    files = LabFiles.of()
    state = read_state(files)
    nodes = int(state.get("nodes", 0))
    if not nodes:
        return files, [], state
    specs = hosts_for(nodes)
    with ThreadPoolExecutor(max_workers=min(nodes, 8)) as pool:
        lab_fabric = state.get("fabric", "lab") != "setup"
        result = list(pool.map(lambda s: host_status(files, s, deep, lab_fabric), specs))
    return files, result, state


# ------------------------------------------------------------------------------------------- down
def _remove_host(files: LabFiles, spec: HostSpec) -> None:
    paths = HostPaths.of(spec.name, files.root)
    hosts.teardown_processes(paths, remove_run=True)
    net.delete_host_net(spec)
    if paths.root.exists():
        shutil.rmtree(paths.root, ignore_errors=True)


def _known_nodes(files: LabFiles) -> int:
    """How many hosts may exist: from lab.json, else from what is lying around after a crash."""
    n = int(read_state(files).get("nodes", 0))
    for where in (files.root / "hosts", NS_DIR, RUN_DIR, Path("/run/netns")):
        if where.is_dir():
            for entry in where.iterdir():
                if entry.name.startswith("spark") and entry.name[5:].isdigit():
                    n = max(n, int(entry.name[5:]))
    return min(n, MAX_NODES)


def down(purge: bool = False) -> None:
    if os.geteuid() != 0:
        raise UsageError("`lab down` needs root", fix="sudo sparkctl lab down")
    with exclusive("down"):
        _down(purge)


def _down(purge: bool) -> None:
    files = LabFiles.of()
    state = read_state(files)
    nodes = _known_nodes(files)
    specs = hosts_for(nodes) if nodes else []
    with ThreadPoolExecutor(max_workers=max(min(nodes, 8), 1)) as pool:
        list(pool.map(lambda s: hosts.teardown_processes(HostPaths.of(s.name, files.root), remove_run=True), specs))
    for spec in specs:
        net.delete_host_net(spec)
    net.remove_forward_rules(state.get("iptables_rules", []))
    net.delete_bridges()
    hosts.release_ns_dir()
    for d in (NS_DIR, RUN_DIR, Path("/run/containerd/s"), Path("/run/containerd")):
        try:
            d.rmdir()  # only when empty: another containerd may use /run/containerd
        except OSError:
            pass
    if files.root.exists():
        if files.marker.exists():
            shutil.rmtree(files.root)
        else:
            say(f"lab: {files.root} has no {files.marker.name} marker; left in place")
    for d in (Path(MODEL_PATH), Path(VLLM_MODEL_PATH), Path(MODEL_PATH).parent):
        try:
            d.rmdir()
        except OSError:
            pass
    if purge:
        image.purge_cache()
    leftovers = [s.name for s in specs if net.netns_exists(s.name)]
    if leftovers:
        raise CheckFailed(f"lab down: namespaces still present: {', '.join(leftovers)}")


def mounts_left() -> list[str]:
    """Mounts of the lab still visible in this namespace (for tests and `down`'s own check)."""
    return [m for m in hosts.mountpoints() if m.startswith((str(RUN_DIR), str(lab_dir())))]


def iptables_rules_now() -> str:
    return out(["iptables", "-S", "FORWARD"], check=False)
