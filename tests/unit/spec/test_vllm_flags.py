"""VLLM_EXTRA_ARGS against vLLM 0.33's real option table (data/vllm-serve-flags.json), offline.

tests/fidelity/test_extra_args_rules.py checks the table against the real parser; these check the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkctl.spec.settings import parse_vllm_extra_args
from sparkctl.spec.vllm_flags import DATA_FILE, OWNED_FLAGS, FlagTable, Option, check_extra_words, flag_table

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


# The flags whose value is a secret, by dest: their value would be on every `docker run` argv, in `config
# --json`, env.tp4, the history, the argv judge's argv and the 0644 systemd unit.
SECRET_DESTS = {"api_key": "VLLM_API_KEY", "hf_token": "HF_TOKEN"}
# Every other dest whose name reads like a secret, and why it is not one (a vLLM update that adds a dest
# matching the pattern fails test_every_secret_looking_dest_is_judged until someone judges it).
NOT_SECRET = {
    "allow_credentials": "a switch (CORS Access-Control-Allow-Credentials)",
    "ssl_keyfile": "a path to the TLS key file, not the key",
    "dbo_decode_token_threshold": "a count of tokens", "dbo_prefill_token_threshold": "a count of tokens",
    "long_prefill_token_threshold": "a count of tokens", "long_prefill_token_threshold_adaptive": "a switch",
    "max_num_batched_tokens": "a count", "max_num_queued_tokens": "a count", "max_num_scheduled_tokens": "a count",
    "enable_prompt_tokens_details": "a switch", "return_tokens_as_token_ids": "a switch", "tokens_only": "a switch",
    "spec_tokens": "a count of speculative tokens", "skip_tokenizer_init": "a switch",
    "enable_tokenizer_info_endpoint": "a switch", "tokenizer": "a tokenizer name or path",
    "tokenizer_mode": "a mode", "tokenizer_revision": "a git revision",
}
_SECRET_LOOKING = __import__("re").compile(r"token|key|secret|passw|credential|auth", __import__("re").I)


def test_every_secret_looking_dest_is_judged() -> None:
    looking = {o.dest for o in TABLE.options.values() if _SECRET_LOOKING.search(o.dest)}
    assert looking == set(SECRET_DESTS) | set(NOT_SECRET)


def _secret_forms() -> list[tuple[str, str]]:
    """(form, knob): every option string of a secret dest, and every prefix argparse expands to it alone."""
    forms = []
    for name, opt in TABLE.options.items():
        if opt.dest in SECRET_DESTS and name.startswith("--"):
            forms += [(name[:n], SECRET_DESTS[opt.dest]) for n in range(3, len(name) + 1)
                      if {o.dest for o in TABLE.resolve(name[:n])} == {opt.dest}]
    return sorted(set(forms))


def test_the_secret_forms_include_the_abbreviations() -> None:
    forms = dict(_secret_forms())
    assert {"--api-key", "--api-k", "--hf-token", "--hf-t"} <= set(forms)
    assert "--hf" not in forms  # ambiguous (--hf-config-path, --hf-overrides): refused as such


@pytest.mark.parametrize(("flag", "knob"), _secret_forms())
def test_a_flag_that_carries_a_secret_is_refused_in_every_form_naming_the_knob(flag: str, knob: str) -> None:
    secret = "s3cr3t-VALUE"
    for text in (f"{flag} {secret}", f"{flag}={secret}", f"--enforce-eager {flag} {secret}", flag):
        msg = _refused(text)
        assert knob in msg and secret not in msg and "\n" not in msg, (text, msg)


@pytest.mark.parametrize("text", ["--hf-token hf_LEAKq1", "--api-key=sk-LEAKq1 --enforce-eager",
                                  "--swap-space 4 --hf-token hf_LEAKq1", "--api-k 'sk-LEAKq1"])
def test_a_refused_value_that_holds_a_secret_flag_is_never_shown(clean_env: dict[str, str], text: str) -> None:
    from sparkctl.errors import UsageError
    from sparkctl.spec.settings import load_settings

    with pytest.raises(UsageError) as exc:
        load_settings(environ={"NODES": "a b c d", "MODEL": "/m", "VLLM_EXTRA_ARGS": text})
    assert "LEAKq1" not in exc.value.message and "VLLM_EXTRA_ARGS=[REDACTED]" in exc.value.message


@pytest.mark.parametrize("args", ['["--hf-token", "hf_LEAKq1"]', '["--api-key=sk-LEAKq1"]', '["--hf-tok", "hf_LEAKq1"]'])
def test_a_recipe_whose_extra_args_carry_a_secret_is_refused(clean_env: dict[str, str], tmp_path: Path,
                                                            args: str) -> None:
    from sparkctl.errors import UsageError
    from sparkctl.spec.recipes import load_recipe

    shipped = Path(load_recipe("lab").path).read_text()
    start = shipped.index("extra_args = [")
    bad = tmp_path / "bad.toml"
    bad.write_text(shipped[:start] + f"extra_args = {args}" + shipped[shipped.index("\n", start):])
    with pytest.raises(UsageError) as exc:
        load_recipe(str(bad))
    assert "LEAKq1" not in exc.value.message and "in the env file" in exc.value.message
