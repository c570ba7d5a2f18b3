"""The VLLM_EXTRA_ARGS rule against vLLM 0.33's own `serve` parser (needs vLLM: the fidelity venv).

Run: SPARKCTL_FIDELITY_VENV/bin/pytest -m fidelity tests/fidelity/test_extra_args_rules.py
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CUDA wheel on a CPU-only host
pytest.importorskip("vllm")

from sparkctl.spec.settings import parse_vllm_extra_args  # noqa: E402
from sparkctl.spec.vllm_flags import DATA_FILE, OWNED_FLAGS, SECRET_FLAGS, flag_table  # noqa: E402
from tests.fidelity import vllm_serve_flags  # noqa: E402

pytestmark = pytest.mark.fidelity

# A value each owned dest's real parser accepts (type conversion runs at parse time).
VALUES = {"speculative_config": '{"method": "mtp", "num_speculative_tokens": 3}', "kv_cache_dtype": "fp8",
          "dcp_comm_backend": "ag_rs", "master_addr": "10.0.0.1", "api_key": "k", "served_model_name": "s",
          "kv_cache_memory_bytes": "1024", "gpu_memory_utilization": "0.5", "model": "/m2"}


@pytest.fixture(scope="module")
def parser():  # type: ignore[no-untyped-def]
    return vllm_serve_flags.serve_parser()


def _parse(parser, argv: list[str]):  # type: ignore[no-untyped-def]
    return parser.parse_args(argv)


def test_the_data_file_is_what_the_real_parser_says_today(parser) -> None:  # type: ignore[no-untyped-def]
    assert json.loads(DATA_FILE.read_text()) == vllm_serve_flags.describe(parser), (
        "vLLM's serve parser changed: rerun tests/fidelity/vllm_serve_flags.py in this venv and review the diff")


def _forms_of(dests: set[str]) -> list[str]:
    """Every option string of `dests`, and every prefix of a long one that argparse expands to that dest alone."""
    table = flag_table()
    forms = []
    for name, opt in table.options.items():
        if opt.dest in dests:
            forms.append(name)
            forms += [name[:n] for n in range(3, len(name)) if name.startswith("--")
                      and {o.dest for o in table.resolve(name[:n])} == {opt.dest}]
    return sorted(set(forms))


def _refused_forms() -> list[str]:
    """Every form of an owned dest that sparkctl refuses as that dest."""
    return _forms_of(set(flag_table().owned_dests()) - {"help", "config"})


@pytest.mark.parametrize("flag", _refused_forms())
def test_each_refused_flag_really_sets_an_owned_dest_in_vllm(parser, flag: str) -> None:  # type: ignore[no-untyped-def]
    table = flag_table()
    opt = table.resolve(flag)[0]
    # the rule refuses it: a long form as owned, a short form as not a full --long-name
    with pytest.raises(ValueError, match="sparkctl sets" if flag.startswith("--") else "full --long-names"):
        parse_vllm_extra_args(f"{flag}=1")
    value = VALUES.get(opt.dest, "3")
    argv = ["/m", flag] if opt.nargs == 0 else ["/m", flag, value]
    default = getattr(_parse(parser, ["/m"]), opt.dest)
    got = getattr(_parse(parser, argv), opt.dest)
    assert got != default, f"{flag} did not set {opt.dest} in vLLM's parser"


@pytest.mark.parametrize("flag", _forms_of(set(flag_table().secret_dests())))
def test_each_refused_secret_flag_really_hands_vllm_that_secret(parser, flag: str) -> None:  # type: ignore[no-untyped-def]
    table = flag_table()
    opt = table.resolve(flag)[0]
    knob = table.secret_dests()[opt.dest]
    for form in ([flag, "s3cr3t"], [f"{flag}=s3cr3t"]):
        with pytest.raises(ValueError, match=f"set {knob} in the env file") as exc:
            parse_vllm_extra_args(" ".join(form))
        assert "s3cr3t" not in str(exc.value)
        got = getattr(_parse(parser, ["/m", *form]), opt.dest)
        assert got in ("s3cr3t", ["s3cr3t"]), f"{form} did not set {opt.dest} in vLLM's parser: {got!r}"


@pytest.mark.parametrize("text", ["--max-num-seqs 8", "--no-enable-prefix-caching", "--enforce-eager --max-num-seq 8",
                                  "--disable-prefix-caching", "--host 127.0.0.1", "--seed=-1",
                                  "--trust-remote-code", "--cudagraph-capture-sizes 1 2 4"])
def test_what_the_rule_accepts_vllm_accepts_and_it_touches_no_owned_dest(parser, text: str) -> None:  # type: ignore[no-untyped-def]
    words = parse_vllm_extra_args(text)
    base = vars(_parse(parser, ["/m"]))
    got = vars(_parse(parser, ["/m", *words]))
    owned = set(flag_table().owned_dests())
    assert {d for d in owned if d in base and got[d] != base[d]} == set()
    assert got != base  # the flags did something


def test_unknown_flags_the_rule_refuses_vllm_refuses(parser) -> None:  # type: ignore[no-untyped-def]
    for flag in ("--swap-space", "--num-scheduler-steps", "--gpu-memory-utilisation"):
        with pytest.raises(ValueError, match="does not have"):
            parse_vllm_extra_args(f"{flag} 4")
        with pytest.raises(SystemExit):
            _parse(parser, ["/m", flag, "4"])


def test_owned_flags_exist_in_vllm(parser) -> None:  # type: ignore[no-untyped-def]
    registry = parser._option_string_actions
    assert sorted(f for f in [*OWNED_FLAGS, *SECRET_FLAGS] if f not in registry) == []
