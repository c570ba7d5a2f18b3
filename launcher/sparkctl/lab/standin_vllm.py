#!/usr/bin/env python3
"""A stand-in for `vllm serve`, for the lab only (stdlib only; installed as /usr/local/bin/vllm).

It takes the same command line as vLLM's multi-node mp backend, so sparkctl runs exactly the argv it
runs in production, and it behaves like vLLM where sparkctl can observe it:

- flags: vLLM's names (argparse, prefix matching on); an unknown flag exits 2 "unrecognized arguments";
- rendezvous: rank 0 listens on --master-addr:--master-port; `--headless` ranks connect to it from
  the IPv4 of the interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (retrying until a
  deadline, in either start order); a missing interface, one without IPv4, or one that cannot reach
  the master fails like Gloo/NCCL do. All --nnodes ranks must join before loading;
- loading: reads every shard's safetensors header (index -> shards); a missing shard kills the rank;
- serving (rank 0 only): /health, /version, /v1/models, /v1/chat/completions, /v1/completions
  (streaming or not), /metrics with vLLM's metric names; the port stays closed until loaded;
- failure: ranks heartbeat over the rendezvous sockets; if any rank dies the head answers /health
  503 and exits non-zero, and the workers exit when the master goes away.

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
from typing import Any

VERSION = "0.33.0"
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
WORDS = ("The lab engine answers with these words so that every benchmark sees the same "
         "tokens at the same rate on every run and on every rank of the cluster").split()


# ----------------------------------------------------------------------------------------- logging
def log(level: str, where: str, msg: str) -> None:
    """One vLLM-shaped log line: `INFO 11-29 10:01:11 [file.py:123] message`."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"{level} {stamp} [{where}] {msg}", file=sys.stderr, flush=True)


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


def build_parser() -> argparse.ArgumentParser:
    """`vllm serve` with the flags sparkctl's recipes use (and common neighbours), vLLM's defaults."""
    top = argparse.ArgumentParser(prog="vllm", allow_abbrev=True)
    top.add_argument("-v", "--version", action="version", version=VERSION)
    sub = top.add_subparsers(dest="subcommand", required=True)
    p = sub.add_parser("serve", prog="vllm serve", allow_abbrev=True,
                       help="Start the vLLM OpenAI Compatible API server.")
    p.add_argument("model_tag", nargs="?", help="The model tag to serve")
    p.add_argument("--model", dest="model_flag")
    a = p.add_argument
    # server
    a("--host", default=None)
    a("--port", type=int, default=8000)
    a("--api-key", default=None)
    a("--served-model-name", nargs="+", default=None)
    a("--uvicorn-log-level", default="info")
    a("--disable-uvicorn-access-log", action="store_true")
    a("--disable-log-stats", action="store_true")
    a("--enable-log-requests", action="store_true")
    a("--disable-log-requests", action="store_true")
    a("--chat-template", default=None)
    a("--reasoning-parser", default=None)
    a("--tool-call-parser", default=None)
    a("--enable-auto-tool-choice", action="store_true")
    a("--headless", action="store_true")
    # model / load
    a("--tokenizer", default=None)
    a("--trust-remote-code", action="store_true")
    a("--dtype", default="auto")
    a("--quantization", "-q", default=None)
    a("--load-format", default="auto")
    a("--seed", type=int, default=None)
    a("--max-model-len", type=parse_size, default=None)
    a("--enforce-eager", action="store_true")
    a("--compilation-config", "-O", default=None)
    a("--generation-config", default="auto")
    # parallelism
    a("--tensor-parallel-size", "-tp", type=int, default=1)
    a("--pipeline-parallel-size", "-pp", type=int, default=1)
    a("--data-parallel-size", "-dp", type=int, default=1)
    a("--decode-context-parallel-size", "-dcp", type=int, default=1)
    a("--dcp-comm-backend", choices=("ag_rs", "a2a"), default=None)
    a("--distributed-executor-backend", choices=("mp", "ray", "uni", "external_launcher"), default=None)
    a("--nnodes", "-n", type=int, default=1)
    a("--node-rank", "-r", type=int, default=0)
    a("--master-addr", default="127.0.0.1")
    a("--master-port", type=int, default=29501)
    a("--disable-custom-all-reduce", action="store_true")
    # cache / scheduler
    a("--kv-cache-dtype", default="auto")  # no choices, as in vLLM: a typo fails after loading
    a("--kv-cache-memory-bytes", type=parse_size, default=None)
    a("--gpu-memory-utilization", type=float, default=0.92)
    a("--block-size", type=int, default=None)
    a("--enable-prefix-caching", type=str_bool, nargs="?", const=True, default=None)
    a("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=parse_size, default=None)
    a("--enable-chunked-prefill", type=str_bool, nargs="?", const=True, default=None)
    a("--async-scheduling", action="store_true")
    a("--speculative-config", "-sc", type=parse_json, default=None)
    return top


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.model = args.model_flag or args.model_tag
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
        self.dead = threading.Event()
        self.dead_reason = ""
        self.hb = env_float("STANDIN_HEARTBEAT_S", 1.0)
        self.hb_timeout = max(5 * self.hb, 3.0)

    # -- head
    def serve_rendezvous(self) -> None:
        args = self.args
        ifname, addr = check_pin()
        bind_addr = args.master_addr
        log("INFO", "parallel_state.py", f"rank 0 of {args.nnodes}: rendezvous on {bind_addr}:{args.master_port}"
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
                log("WARNING", "parallel_state.py", f"refused {peer[0]}: {problem}")
                try:
                    link.send({"error": problem})
                finally:
                    conn.close()
                continue
            assert hello is not None
            self.links[int(hello["rank"])] = link
            log("INFO", "parallel_state.py", f"rank {hello['rank']} joined from {peer[0]} "
                f"({hello.get('ifname') or 'no pin'}) [{len(self.links) + 1}/{args.nnodes}]")
        srv.close()
        for link in self.links.values():
            link.send({"welcome": True})
        log("INFO", "parallel_state.py", f"world_size={args.nnodes} rendezvous complete "
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
        log("INFO", "parallel_state.py", f"rank {args.node_rank} of {args.nnodes}: joining {target[0]}:{target[1]}"
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
                    log("INFO", "parallel_state.py", f"master {target[0]}:{target[1]} not reachable yet ({exc}); retrying")
                time.sleep(0.5)
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
        log("INFO", "parallel_state.py", f"world_size={args.nnodes} rendezvous complete; this is rank {args.node_rank}")

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
        while not self.dead.is_set():
            try:
                link.recv(self.hb)
            except (ConnectionError, OSError, ValueError) as exc:
                on_death(f"{who} died: {exc}")
                return
            if time.monotonic() - link.last_seen > self.hb_timeout:
                on_death(f"{who} missed heartbeats for {self.hb_timeout:.0f}s")
                return


# ----------------------------------------------------------------------------------------- loading
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
    index_path = os.path.join(model, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        shards = sorted(n for n in os.listdir(model) if n.endswith(".safetensors"))
    if not shards:
        die(f"RuntimeError: Cannot find any model weights with `{model}`")
    log("INFO", "gpu_model_runner.py", f"Starting to load model {model}...")
    tensors = 0
    nbytes = 0
    for shard in shards:
        path = os.path.join(model, shard)
        try:
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                if hlen > 100 * 2**20:
                    raise ValueError(f"header length {hlen} is implausible")
                header = json.loads(f.read(hlen))
        except FileNotFoundError:
            die(f"FileNotFoundError: [Errno 2] No such file or directory: '{path}' "
                f"(shard named in model.safetensors.index.json)")
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
    log("INFO", "default_loader.py", f"Loading weights took {took:.2f} seconds ({len(shards)} shards, {tensors} tensors)")
    log("INFO", "gpu_model_runner.py", f"Model loading took {nbytes / 2**30:.4f} GiB and {took:.6f} seconds")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:  # vLLM only notices after the weights are in
        die(f"ValueError: Unknown kv cache dtype: {args.kv_cache_dtype!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
    if args.kv_cache_memory_bytes is not None:
        log("INFO", "gpu_worker.py", f"Reserved {args.kv_cache_memory_bytes} bytes for the KV cache "
            "(--kv-cache-memory-bytes; gpu_memory_utilization not used for sizing)")
    if not args.enforce_eager:
        gdelay = env_float("STANDIN_GRAPH_DELAY_S", 0.0)
        if gdelay > 0:
            time.sleep(gdelay)
        log("INFO", "gpu_model_runner.py", f"Graph capturing finished in {max(gdelay, 0.01):.0f} secs")
    return {"config": config, "shards": len(shards), "tensors": tensors, "bytes": nbytes}


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
        if path == "/health":
            self.send_response(503 if self.cluster.dead.is_set() else 200)
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
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"detail": "Not Found"})
            return
        if not self._authorized():
            return
        if self.cluster.dead.is_set():
            self._error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                        "InternalServerError")
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            self._error(400, "request body is not a JSON object", "BadRequestError")
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
                if self.cluster.dead.is_set():
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
    log("INFO", "api_server.py", f"vLLM API server version {VERSION} (lab stand-in)")
    log("INFO", "utils.py", f"non-default args: model={args.model!r}, tp={args.tensor_parallel_size}, "
        f"dcp={args.decode_context_parallel_size}, nnodes={args.nnodes}, node_rank={args.node_rank}, "
        f"headless={args.headless}")
    cluster = Cluster(args)
    head = args.node_rank == 0
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
        if cluster.dead.is_set():
            return
        cluster.dead.set()
        cluster.dead_reason = reason
        log("ERROR", "core_client.py", f"Engine core proc died unexpectedly: {reason}; shutting down")
        if not head or server is None:
            die(f"RuntimeError: {reason}")
        # Let /health answer 503 for a moment (a real head does), then leave non-zero.
        linger = env_float("STANDIN_DEATH_LINGER_S", 3.0)
        threading.Timer(linger, lambda: die(f"RuntimeError: {reason}")).start()

    def on_signal(signum: int, _frame: Any) -> None:
        log("INFO", "launcher.py", f"Shutting down (signal {signum})")
        stopped.set()
        cluster.dead.set()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster.start_heartbeat(on_death)
    if not head:
        log("INFO", "multiproc_executor.py", f"headless rank {args.node_rank} ready; serving no HTTP")
        while not stopped.wait(1.0):
            pass
        return 0
    server = make_server(args, cluster, engine)
    log("INFO", "launcher.py", f"Starting vLLM API server 0 on http://{args.host or '0.0.0.0'}:{args.port}")
    log("INFO", "launcher.py", "Available routes are: /health, /version, /metrics, /v1/models, "
        "/v1/chat/completions, /v1/completions")
    log("INFO", "on.py", "Application startup complete.")
    server.serve_forever(poll_interval=0.25)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
