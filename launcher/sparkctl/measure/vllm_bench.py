"""`bench --tool vllm`: vLLM's own `vllm bench serve`, beside sparkctl's figures, on the same load.

It runs inside the head's container (the serving image has vLLM), through `docker exec` over
sparkctl's SSH connection to the head, against the head's own port on loopback, with the load
sparkctl's run used: per concurrency level, --max-concurrency C, --num-prompts N, random prompts of
--input-len tokens (vLLM's random dataset, the served model's tokenizer from the mounted MODEL),
--output-len tokens with --ignore-eos, the same request rate and seed, the card's sampling. vLLM's
result JSON (`--save-result`) comes back on stdout after a marker line; its own printout goes to
stderr. The API key travels on stdin into OPENAI_API_KEY (what vLLM's client sends), never on a
command line. Pure builders here (argv, the script, parsing, the table); commands/bench.py runs them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import CheckFailed
from ..facts.parsing import ParseError, parse_json

MARKER = "@@sparkctl-vllm-bench"
DEFAULT_INPUT_LEN = 128  # --tool vllm needs a prompt length in tokens (vLLM's random dataset); sparkctl builds the same

# Run by `sh -c SCRIPT sh ARGV...` in the container: the key on stdin's first line (may be empty), the
# result into a private temp dir, printed after MARKER, the dir removed whatever happens.
SCRIPT = (
    'IFS= read -r key || key=""\n'
    '[ -n "$key" ] && export OPENAI_API_KEY="$key"\n'
    "unset key\n"
    # vLLM's client honours proxy variables: the key goes to the engine on loopback, never to a proxy
    "unset http_proxy HTTP_PROXY https_proxy HTTPS_PROXY all_proxy ALL_PROXY no_proxy NO_PROXY\n"
    'dir=$(mktemp -d) || exit 3\n'
    "trap 'rm -rf \"$dir\"' EXIT\n"
    '"$@" --save-result --result-dir "$dir" --result-filename result.json >&2 || exit $?\n'
    f"printf '%s\\n' '{MARKER}'\n"
    'cat "$dir/result.json"\n'
)


def bench_serve_argv(*, base_url: str, model: str, tokenizer: str, input_len: int, output_len: int,
                     num_prompts: int, max_concurrency: int, request_rate: float | None = None, seed: int = 0,
                     temperature: float = 0.6, top_p: float = 0.95) -> list[str]:
    """`vllm bench serve` with sparkctl's load (one level)."""
    argv = ["vllm", "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
            "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(max_concurrency), "--ignore-eos",
            "--seed", str(seed), "--temperature", repr(temperature), "--top-p", repr(top_p),
            "--extra-body", json.dumps({"chat_template_kwargs": {"enable_thinking": False}}),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if request_rate is not None:
        argv += ["--request-rate", repr(request_rate)]
    return argv


def exec_argv(container: str, argv: Sequence[str]) -> list[str]:
    """docker exec of SCRIPT with `argv` as its positional arguments (never spliced into the script)."""
    return ["docker", "exec", "-i", container, "sh", "-c", SCRIPT, "sh", *argv]


def parse_result(stdout: str, where: str) -> dict[str, Any]:
    """vLLM's result JSON after MARKER; CheckFailed naming `where` when it is not there."""
    head, sep, rest = stdout.partition(MARKER + "\n")
    if not sep:
        raise CheckFailed(f"vllm bench serve on {where} printed no result",
                          fix="see its output above; the serving image must have vLLM with `vllm bench serve`")
    try:
        doc = parse_json(rest)
    except ParseError as exc:
        raise CheckFailed(f"vllm bench serve on {where}: its result is {exc}") from None
    if not isinstance(doc, dict):
        raise CheckFailed(f"vllm bench serve on {where}: its result is not a JSON object")
    return doc


# metric key (vLLM's), label, decimals
COMPARED = (
    ("completed", "completed", 0), ("total_input_tokens", "input tokens (server's usage)", 0),
    ("total_output_tokens", "output tokens", 0), ("request_throughput", "request throughput (req/s)", 3),
    ("output_throughput", "output throughput (tok/s)", 1), ("mean_ttft_ms", "mean TTFT (ms)", 1),
    ("median_ttft_ms", "median TTFT (ms)", 1), ("p99_ttft_ms", "P99 TTFT (ms)", 1),
    ("mean_tpot_ms", "mean TPOT (ms)", 2), ("median_tpot_ms", "median TPOT (ms)", 2),
    ("mean_itl_ms", "mean ITL (ms)", 2), ("median_e2el_ms", "median E2EL (ms)", 1),
)


def side_by_side(pairs: Sequence[tuple[int, dict[str, Any], dict[str, Any]]]) -> str:
    """One table per level: sparkctl's figure, vLLM's, and the difference in % of vLLM's."""
    out: list[str] = []
    for c, mine, theirs in pairs:
        out += [f"C={c}: sparkctl bench and `vllm bench serve` on the same load", "",
                "| metric | sparkctl | vllm bench serve | diff |", "|---|---:|---:|---:|"]
        for key, label, nd in COMPARED:
            a, b = mine.get(key), theirs.get(key)
            diff = f"{(a - b) / b * 100:+.1f}%" if isinstance(a, int | float) and isinstance(b, int | float) and b \
                else "—"
            out.append(f"| {label} | {_num(a, nd)} | {_num(b, nd)} | {diff} |")
        if isinstance(mine.get("n_ttft"), int) and mine["n_ttft"] < 100:
            out.append(f"(P99 over {mine['n_ttft']} requests: sparkctl prints none below 100, vLLM prints it anyway)")
        out.append("")
    return "\n".join(out).rstrip()


def _num(v: Any, nd: int) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "—"
    return f"{v:,.{nd}f}"
