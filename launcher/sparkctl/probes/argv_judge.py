"""Judge every rank's `vllm serve` argv with the serving image's own vLLM (sparkctl's argvjudge).

Run inside the serving image on the head, as `python3 - RANKS_JSON` (this file on stdin, `--network
none`, the model folder mounted read-only; RANKS_JSON = [{"rank": R, "argv": ["vllm", "serve", ...]}]):
nodes have no sparkctl, the image has vLLM. It starts nothing: it asks the image's vLLM what `vllm
serve` would say about each argv before any rank starts.

  parse      the parser `vllm serve` builds (vllm/entrypoints/cli/main.py: a FlexibleArgumentParser,
             ServeSubcommand.subparser_init), then ServeSubcommand.validate: an unknown flag or a
             value outside a flag's choices is refused with argparse's own words
  config     AsyncEngineArgs.from_cli_args + create_engine_config: ModelConfig from the checkpoint's
             config.json (an architecture this vLLM does not know), ParallelConfig, CacheConfig
  attention  on vLLM's CPU platform, the CPU attention backend's own head-size table
             (CPUAttentionBackend.get_supported_head_sizes / supports_head_size)

One line per rank: `@@sparkctl-argv {json}` with rank, verdict (ok | refused | not-judged), stage,
words (vLLM's) and vllm (its version). Exit 0 whatever the verdicts.
"""

import contextlib
import io
import json
import os
import sys

MARK = "@@sparkctl-argv "


class Verdict(Exception):
    def __init__(self, verdict, stage, words=""):
        super().__init__(words)
        words = words.strip()
        if len(words) > 1200:  # vLLM's lists (every architecture it knows) run long: its first words say why
            words = words[:1000] + " …"
        self.doc = {"verdict": verdict, "stage": stage, "words": words}


def last_words(text):
    """argparse's message: its error line (the usage lines before it are noise)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ": error:" in ln]
    return errors[-1] if errors else "\n".join(lines[-3:])


def reason(exc):
    return f"{type(exc).__name__}: {exc}"


def load_vllm():
    """The image's vLLM: its version and the three things the judge asks of it."""
    try:
        import vllm
    except Exception as exc:  # the lab's stand-in engine, or an image without vLLM for python3
        raise Verdict("not-judged", "import", f"python3 in this image cannot import vllm ({reason(exc)})") from None
    version = str(getattr(vllm, "__version__", "?"))
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.cli.serve import ServeSubcommand
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:  # older vLLM kept it in vllm.utils
            from vllm.utils import FlexibleArgumentParser
    except Exception as exc:
        raise Verdict("not-judged", "import", f"vLLM {version}'s serve parser could not be imported ({reason(exc)})") from None
    return version, AsyncEngineArgs, ServeSubcommand, FlexibleArgumentParser


def judge(argv, AsyncEngineArgs, ServeSubcommand, FlexibleArgumentParser):
    if argv[:2] != ["vllm", "serve"]:
        raise Verdict("not-judged", "parse", f"not a `vllm serve` argv: {argv[:2]}")
    root = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = root.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand().subparser_init(subparsers)
    serve.set_defaults(dispatch_function=ServeSubcommand.cmd)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = root.parse_args(argv[1:])
            ServeSubcommand().validate(args)
    except SystemExit as exc:
        if exc.code in (0, None):
            raise Verdict("refused", "parse", "vllm serve exits before serving (--help or --version in the argv?)") from None
        raise Verdict("refused", "parse", last_words(err.getvalue()) or f"argparse exit {exc.code}") from None
    except Exception as exc:
        raise Verdict("refused", "parse", reason(exc)) from None
    if getattr(args, "model_tag", None) is not None:  # what ServeSubcommand.cmd does first
        args.model = args.model_tag

    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        with contextlib.redirect_stderr(err):
            config = engine_args.create_engine_config()
    except SystemExit as exc:
        raise Verdict("refused", "config", last_words(err.getvalue()) or f"exit {exc.code}") from None
    except Exception as exc:
        raise Verdict("refused", "config", reason(exc)) from None

    try:
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
    except Exception:
        on_cpu = False
    if not on_cpu:
        return Verdict("ok", "config")
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        model_config = config.model_config
        use_mla = bool(getattr(model_config, "use_mla", False))
        head = int(model_config.get_head_size())
    except Exception as exc:
        return Verdict("ok", "config", f"the CPU attention table was not consulted ({reason(exc)})")
    if not use_mla and not CPUAttentionBackend.supports_head_size(head):
        raise Verdict("refused", "attention",
                      f"head_size not supported: {CPUAttentionBackend.get_name()} (vLLM's CPU attention) supports "
                      f"head sizes {CPUAttentionBackend.get_supported_head_sizes()}, this model's is {head}")
    return Verdict("ok", "attention")


def main(ranks_json):
    sys.argv[0] = "vllm"  # argparse names the program in its words: `vllm serve: error: ...`
    for key, value in (("VLLM_LOGGING_LEVEL", "ERROR"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("VLLM_NO_USAGE_STATS", "1")):
        os.environ.setdefault(key, value)
    ranks = json.loads(ranks_json)
    try:
        version, *parts = load_vllm()
    except Verdict as missing:
        version, parts, common = "", None, missing
    for item in ranks:
        if parts is None:
            v = common
        else:
            try:
                v = judge([str(w) for w in item["argv"]], *parts)
            except Verdict as refused:
                v = refused
            except Exception as exc:  # the judge's own trouble is no verdict on the argv
                v = Verdict("not-judged", "judge", reason(exc))
        sys.stdout.write("\n" + MARK + json.dumps({"rank": item["rank"], **v.doc, "vllm": version}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
