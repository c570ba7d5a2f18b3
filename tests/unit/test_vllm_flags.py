"""VLLM_EXTRA_ARGS against vLLM 0.33's real option table (data/vllm-serve-flags.json), offline.

tests/fidelity/test_extra_args_rules.py checks the table against the real parser; these check the rule."""

from __future__ import annotations

import json

import pytest

from sparkctl.settings import parse_vllm_extra_args
from sparkctl.vllm_flags import DATA_FILE, OWNED_FLAGS, FlagTable, Option, check_extra_words, flag_table

TABLE = flag_table()
OWNED = TABLE.owned_dests()


def _refused(text: str) -> str:
    with pytest.raises(ValueError) as exc:
        parse_vllm_extra_args(text)
    return str(exc.value)


def test_the_table_is_vllm_0_33s_serve_parser() -> None:
    doc = json.loads(DATA_FILE.read_text())
    assert doc["vllm_version"] == "0.33.0" and doc["allow_abbrev"] is True
    # what the fidelity suite saw in the real parser: the alias that bypassed the cap, -cc (no -O)
    assert TABLE.options["--device-memory-utilization"].dest == "gpu_memory_utilization"
    assert "-cc" in TABLE.options and "-O" not in TABLE.options
    assert TABLE.options["--no-enable-prefix-caching"].dest == "enable_prefix_caching"


def test_the_cap_bypass_is_closed() -> None:
    msg = _refused("--device-memory-utilization 0.95")
    assert "GPU_MEMORY_UTILIZATION" in msg and "--gpu-memory-utilization" in msg


@pytest.mark.parametrize("flag", sorted(n for n, o in TABLE.options.items()
                                        if o.dest in OWNED and n.startswith("--")))
def test_every_long_alias_of_an_owned_dest_is_refused_in_every_form(flag: str) -> None:
    knob = OWNED[TABLE.options[flag].dest]
    for text in (f"{flag} 1", f"{flag}=1", f"--enforce-eager {flag}=1"):
        assert knob in _refused(text), text
    # every prefix argparse would expand to this flag alone (allow_abbrev is on in vLLM 0.33)
    for n in range(3, len(flag)):
        prefix = flag[:n]
        matches = [o for n, o in TABLE.options.items() if n.startswith(prefix) and n.startswith("--")]
        if any(m.dest in OWNED for m in matches):
            assert "sparkctl sets" in _refused(f"{prefix}=1"), prefix


def test_owned_flags_cover_what_sparkctl_renders() -> None:
    # every flag builders.vllm_serve_argv writes is owned (so a user cannot set it twice)
    rendered = ["--served-model-name", "--port", "--tensor-parallel-size", "--decode-context-parallel-size",
                "--dcp-comm-backend", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                "--max-model-len", "--kv-cache-dtype", "--kv-cache-memory-bytes", "--gpu-memory-utilization",
                "--speculative-config", "--headless"]
    assert set(rendered) <= set(OWNED_FLAGS)


@pytest.mark.parametrize(("text", "expected"), [
    ("--speculative-config.method=mtp", "SPEC_METHOD"),
    ("--speculative-config.num_speculative_tokens 5", "SPEC_METHOD"),
    ("--config /etc/v.yaml", "a vLLM config file"),
    ("--model /other", "MODEL"),
    ("--help", "prints help"),
    ("--swap-space 4", "does not have"),
    ("--gpu-memory-utilisation 0.9", "did you mean --gpu-memory-utilization"),
    ("--enable-pre 1", "takes no value"),
    ("--chat-template a b", "takes one value"),
    ("--enable-p", "ambiguous"),
])
def test_refusals(text: str, expected: str) -> None:
    msg = _refused(text)
    assert expected in msg and "\n" not in msg


@pytest.mark.parametrize("text", [
    "--max-num-seqs 8", "--no-enforce-eager", "--enforce-eager --max-num-seq 8", "--trust-remote-code",
    "--disable-prefix-caching", "--host 127.0.0.1", "--seed=-1", "--compilation-config.mode=3",
    "--max-num-batched-tokens 8192", "--cudagraph-capture-sizes 1 2 4 8 --enforce-eager",
])
def test_accepted(text: str) -> None:
    assert parse_vllm_extra_args(text) == text.split()


def test_a_table_that_lacks_an_owned_flag_is_a_bug_not_bad_input() -> None:
    table = FlagTable("9.9", {"--port": Option("--port", "port", None)})
    with pytest.raises(RuntimeError, match="OWNED_FLAGS"):
        check_extra_words(["--port", "1"], table)
