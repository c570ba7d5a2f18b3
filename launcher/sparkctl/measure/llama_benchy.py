"""`bench --tool llama-benchy`: llama-benchy 0.4 (the tool behind Spark Arena's shared results; the optional
extra `sparkctl-launcher[llama-benchy]`) run from this machine on the same endpoint and the same load, its result
beside sparkctl's. Pure: the argv, the result's reader, the side-by-side table; orchestrate.bench runs it.

It downloads nothing at run time, by its own flags and environment:
- `--tokenizer FILE`: the served model's own tokenizer.json, copied from MODEL on the head (llama-benchy
  reads a local tokenizer.json with `tokenizers` before it would ask a hub);
- `--book-url`: its prompt text (a Project Gutenberg book by default) served from this process on
  loopback: the compared workload's prompts;
- `--model` given (no look-up of the served name on huggingface.co), HF_HUB_OFFLINE=1 and
  TRANSFORMERS_OFFLINE=1 (a hub fallback fails instead of downloading), HOME a temporary folder (its
  text cache goes there and is removed), and no proxy variable at all (`environment`: the API key goes
  to the head only).

The load: llama-benchy sends a level as `--runs` batches of C requests at once (after its own warm-up),
prompts of `--pp` tokens as the server counts them (chat template included: it adapts the text to the
warm-up's usage) and `--tg` output tokens forced with `--exact-tg` (ignore_eos). sparkctl's level of n
requests at C is matched with ceil(n / C) runs: the same requests, a batch-synchronous shape where
sparkctl runs a closed loop. Its figures are its own definitions: e2e_ttft (ms, to the first content
token), tg_req_throughput ((N − 1) ÷ (last token − first token), per request), tg_throughput (all
requests' generation rate).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckFailed
from ..facts.parsing import ParseError, parse_json

MODULE = "llama_benchy"
EXTRA = "pip install 'sparkctl-launcher[llama-benchy]'"


def available() -> bool:
    """Whether llama-benchy can be run by this interpreter (the optional extra is installed)."""
    return importlib.util.find_spec(MODULE) is not None


def runs_for(requests: int, concurrency: int) -> int:
    """llama-benchy's --runs for a level of `requests` requests at `concurrency`: the same number of requests."""
    return max(1, math.ceil(requests / concurrency))


# llama-benchy reads the API key only from its command line, where every user of this machine could read it
# (/proc/PID/cmdline, ps). So it is started through this launcher: the key arrives on stdin's first line and is
# added to llama-benchy's own sys.argv inside the process, which the process's command line never shows.
LAUNCH = (
    "import runpy, sys\n"
    "key = sys.stdin.readline().rstrip('\\n')\n"
    "sys.argv = [sys.argv[0], *sys.argv[1:], *(['--api-key', key] if key else [])]\n"
    f"runpy.run_module({MODULE!r}, run_name='__main__', alter_sys=True)\n"
)


def argv(*, python: str, base_url: str, model: str, tokenizer: str, input_len: int, output_len: int,
         concurrency: int, runs: int, book_url: str, result: str) -> list[str]:
    """The command line of one level (no secret in it: the API key goes on stdin, `LAUNCH`). `base_url` is the
    API's root (…:PORT, llama-benchy adds nothing: /v1 is appended here)."""
    return [python, "-c", LAUNCH, "--base-url", f"{base_url.rstrip('/')}/v1", "--model", model,
            "--served-model-name", model, "--tokenizer", tokenizer, "--pp", str(input_len), "--tg", str(output_len),
            "--exact-tg", "--concurrency", str(concurrency), "--runs", str(runs), "--no-cache",
            "--book-url", book_url, "--skip-coherence", "--latency-mode", "api", "--format", "json",
            "--save-result", result]


def environment(parent: Mapping[str, str], work: Path) -> dict[str, str]:
    """llama-benchy's environment: this one without a single proxy variable (http_proxy, HTTPS_PROXY,
    ALL_PROXY, NO_PROXY, any case: aiohttp and requests in llama-benchy honour them, and a lower-case
    no_proxy that leaves the head out would send the API key to the proxy), offline, HOME in `work`."""
    env = {k: v for k, v in parent.items() if not k.lower().endswith("_proxy")}
    return env | {"HOME": str(work), "HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def stdin_for(api_key: str | None) -> str:
    """What `LAUNCH` reads: the key's line (empty: no key)."""
    return (api_key or "") + "\n"


def read_result(path: Path, where: str) -> dict[str, Any]:
    """llama-benchy's JSON result (`--format json --save-result`); CheckFailed when it is missing or damaged."""
    try:
        doc = parse_json(path.read_bytes())
    except OSError:
        raise CheckFailed(f"llama-benchy on {where} wrote no result", fix="see its output above") from None
    except ParseError as exc:
        raise CheckFailed(f"llama-benchy on {where}: its result is {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise CheckFailed(f"llama-benchy on {where}: its result has no \"benchmarks\" list")
    return doc


def level_of(doc: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    """The result's measurement at `concurrency` (not a context-prefill phase), or None."""
    for run in doc.get("benchmarks", []):
        if isinstance(run, dict) and run.get("concurrency") == concurrency and not run.get("is_context_prefill_phase"):
            return run
    return None


def _mean(run: dict[str, Any] | None, key: str) -> float | None:
    m = (run or {}).get(key)
    v = m.get("mean") if isinstance(m, dict) else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


# (label, sparkctl's figure from its level, llama-benchy's key, decimals)
COMPARED = (
    ("mean TTFT (ms)", lambda lv: lv.get("mean_ttft_ms"), "e2e_ttft", 1),
    ("per-request decode tok/s", lambda lv: (lv.get("per_stream_tok_s") or {}).get("mean"), "tg_req_throughput", 2),
    ("output / generation tok/s (all requests)", lambda lv: lv.get("output_throughput"), "tg_throughput", 1),
)


def side_by_side(pairs: Sequence[tuple[int, dict[str, Any], dict[str, Any] | None]]) -> str:
    """One table per level: sparkctl's figure, llama-benchy's (its own definition) and the difference in %."""
    out: list[str] = []
    for c, mine, theirs in pairs:
        out += [f"C={c}: sparkctl bench and llama-benchy on the same endpoint and load", "",
                "| metric | sparkctl | llama-benchy | diff |", "|---|---:|---:|---:|"]
        for label, get, key, nd in COMPARED:
            a, b = get(mine), _mean(theirs, key)
            a = float(a) if isinstance(a, int | float) and not isinstance(a, bool) else None
            diff = f"{(a - b) / b * 100:+.1f}%" if a is not None and b else "—"
            out.append(f"| {label} | {_num(a, nd)} | {_num(b, nd)} | {diff} |")
        if theirs is None:
            out.append("(llama-benchy's result has no measurement at this concurrency)")
        out.append("")
    if out:
        out.append("llama-benchy's definitions: TTFT to the first content token; decode (N − 1) ÷ (last − first token); "
                   "its level is batches of C requests at once, sparkctl's a closed loop of C streams.")
    return "\n".join(out).rstrip()


def _num(v: float | None, nd: int) -> str:
    return "—" if v is None else f"{v:,.{nd}f}"
