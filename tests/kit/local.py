"""The stand-in engine as a single rank on loopback (no lab needed): for unit tests and benchmarks
that want a real OpenAI-compatible server with a known decode speed, TTFT and acceptance."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import sparkctl.lab
from sparkctl.errors import CheckFailed

STANDIN = Path(sparkctl.lab.__file__).resolve().parent / "standin_vllm.py"  # the engine the lab ships


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def local_standin(model: Path, *, env: Mapping[str, str], served_name: str = "m",
                  extra_args: Sequence[str] = (), start_timeout: float = 20, host: str = "127.0.0.1",
                  port: int | None = None) -> Iterator[str]:
    """`vllm serve MODEL --nnodes 1` on `host` (a loopback address: 127.0.0.1 unless told, e.g. 127.0.0.2
    for a second head on the same port) with STANDIN_* from `env`; yields its base URL."""
    port = port or free_port(host)
    argv = [sys.executable, str(STANDIN), "serve", str(model), "--nnodes", "1", "--host", host,
            "--port", str(port), "--served-model-name", served_name, "--disable-uvicorn-access-log", *extra_args]
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + start_timeout
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:  # noqa: S310 - loopback
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise CheckFailed(f"the stand-in engine did not start on {url}: {err[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
