"""sparkctl's fabric test: one rank of an all-reduce over torch.distributed (stdlib + torch only).

Shipped to each rank on stdin (`python3 - ARGS`) and run inside a short-lived container of the image
that will serve, with the environment `up` would give that rank (NCCL_SOCKET_IFNAME, NCCL_IB_HCA,
GLOO_SOCKET_IFNAME, ...). It joins the rendezvous at tcp://MASTER_ADDR:PORT, all-reduces buffers of
the given sizes and times them as nccl-tests does: algbw = bytes / time, busbw = algbw * 2(n-1)/n.

Output: one JSON document per line, each prefixed with `@@sparkctl-fabric ` (NCCL's own
NCCL_DEBUG=INFO lines share stdout, so the prefix tells them apart). Events: start, joined, result
(one per size), error, timeout, done. The whole run is bounded by --deadline seconds: a watchdog
prints a `timeout` event naming the stage it was in and exits 3. Exit: 0 ok, 1 error, 3 timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

MARK = "@@sparkctl-fabric "
_state = {"stage": "import", "rank": -1}
_lock = threading.Lock()


def emit(event: str, **fields: object) -> None:
    doc = {"event": event, "rank": _state["rank"], **fields}
    with _lock:
        sys.stdout.write(MARK + json.dumps(doc, separators=(",", ":")) + "\n")
        sys.stdout.flush()


def watchdog(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))
    emit("timeout", stage=_state["stage"])
    os._exit(3)


def busbw_factor(world: int) -> float:
    """nccl-tests' all-reduce factor: 2(n-1)/n (0 for one rank: nothing crosses a link)."""
    return 2.0 * (world - 1) / world


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fabric_allreduce")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--sizes", default="1048576,16777216,67108864,268435456", help="bytes, comma-separated")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--deadline", type=float, default=60.0, help="seconds for the whole run")
    a = p.parse_args(argv)
    _state["rank"] = a.rank
    end = time.monotonic() + a.deadline
    threading.Thread(target=watchdog, args=(end,), daemon=True).start()
    import torch
    import torch.distributed as dist

    nccl = None
    if a.backend == "nccl":
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # a torch without NCCL: init below says so
            nccl = None
    emit("start", world=a.world, backend=a.backend, torch=torch.__version__, nccl=nccl,
         host=socket.gethostname(), pid=os.getpid())
    _state["stage"] = "init"
    t0 = time.monotonic()
    try:
        device = None
        if a.backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        remaining = max(1.0, end - time.monotonic() - 1.0)
        dist.init_process_group(a.backend, init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank,
                                world_size=a.world, timeout=timedelta(seconds=remaining))
        # The first collective is where NCCL builds its rings and connects: count it as joining.
        probe = torch.full((1024,), float(a.rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(probe)
        if device is not None:
            torch.cuda.synchronize()
        want = a.world * (a.world + 1) / 2
        if float(probe[0].item()) != want:
            emit("error", stage="init", error=f"all-reduce returned {probe[0].item()}, expected {want}")
            return 1
    except Exception as exc:
        emit("error", stage="init", error=f"{type(exc).__name__}: {str(exc)[:600]}")
        return 1
    emit("joined", init_s=round(time.monotonic() - t0, 3))
    factor = busbw_factor(a.world)
    for size in [int(s) for s in a.sizes.split(",") if s.strip()]:
        _state["stage"] = f"allreduce {size}"
        try:
            buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            for _ in range(a.warmup):
                dist.all_reduce(buf)
            if device is not None:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(a.iters):
                dist.all_reduce(buf)
            if device is not None:
                torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / max(1, a.iters)
        except Exception as exc:
            emit("error", stage=_state["stage"], error=f"{type(exc).__name__}: {str(exc)[:600]}")
            return 1
        algbw = size / seconds / 1e9
        emit("result", bytes=size, iters=a.iters, time_us=round(seconds * 1e6, 1), algbw_gbps=round(algbw, 4),
             busbw_gbps=round(algbw * factor, 4))
    _state["stage"] = "teardown"
    try:
        dist.destroy_process_group()
    except Exception:  # the figures are in; a slow teardown is not a fabric finding
        pass
    emit("done", total_s=round(time.monotonic() - t0, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
