"""`vllm serve`'s real option table, and the VLLM_EXTRA_ARGS rule built on it.

data/vllm-serve-flags.json is written from vLLM 0.33's own parser by tests/fidelity/vllm_serve_flags.py
(every option string → its dest and how many values it takes); the fidelity suite checks it still
equals the real parser. sparkctl needs no vLLM at run time: it resolves each extra flag as vLLM's
argparse would (exact name, else any unambiguous prefix, `--flag=value` too; aliases and `--no-` forms
are their own option strings with the same dest) and refuses a flag whose dest sparkctl owns or caps,
and a flag vLLM 0.33 does not have (`up` would start every rank only for vLLM to refuse its arguments).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).resolve().parent.parent / "data" / "vllm-serve-flags.json"

# The flags sparkctl sets itself (by their canonical name in vLLM 0.33) and the knob that sets each.
# Refusal is by dest, so every alias, prefix and `--no-` form of these is refused too.
OWNED_FLAGS: dict[str, str] = {
    "--model": "MODEL", "--served-model-name": "SERVED_MODEL_NAME", "--port": "PORT",
    "--tensor-parallel-size": "TP", "--decode-context-parallel-size": "DCP",
    "--dcp-comm-backend": "DCP_COMM_BACKEND", "--nnodes": "NODES", "--node-rank": "NODES",
    "--master-addr": "MASTER_ADDR", "--master-port": "MASTER_PORT", "--max-model-len": "MAX_MODEL_LEN",
    "--kv-cache-dtype": "KV_CACHE_DTYPE", "--kv-cache-memory-bytes": "KV_CACHE_MEMORY_BYTES",
    "--gpu-memory-utilization": "GPU_MEMORY_UTILIZATION (capped by the recipe)",
    "--speculative-config": "SPEC_METHOD/SPEC_K", "--headless": "NODES (every rank but the head)",
    "--config": "the env file (a vLLM config file could set any flag sparkctl owns)",
    "--help": "nothing (it prints help and exits instead of serving)",
}

# The flags whose value is a secret, and the knob that carries it instead (to the containers in a 0600 env
# file, never on a command line). Refused by dest too, in every alias, prefix and `--flag=value` form.
# Judged from the whole table (tests/unit/spec/test_vllm_flags.py::NOT_SECRET lists every other dest whose
# name reads like a secret, and why it is not one: --ssl-keyfile is a path, --allow-credentials a switch).
SECRET_FLAGS: dict[str, str] = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}
_FLAG_WORD = re.compile(r"(?:^|[\s'\"=])(--[A-Za-z0-9-]*)")


@dataclass(frozen=True)
class Option:
    name: str
    dest: str
    nargs: int | str | None  # argparse's: None = one value, 0 = none, "?" / "+" / "*"

    @property
    def takes_value(self) -> bool:
        return self.nargs != 0


@dataclass(frozen=True)
class FlagTable:
    vllm_version: str
    options: dict[str, Option]

    def resolve(self, flag: str) -> list[Option]:
        """The options argparse could take `flag` for: the exact one, else every option it prefixes."""
        if flag in self.options:
            return [self.options[flag]]
        return [o for name, o in self.options.items() if name.startswith(flag) and name.startswith("--")]

    def owned_dests(self) -> dict[str, str]:
        """dest → the knob that sets it, for every dest sparkctl owns."""
        return self._dests(OWNED_FLAGS, "OWNED_FLAGS")

    def secret_dests(self) -> dict[str, str]:
        """dest → the knob that carries it, for every dest whose value is a secret."""
        return self._dests(SECRET_FLAGS, "SECRET_FLAGS")

    def _dests(self, flags: dict[str, str], name: str) -> dict[str, str]:
        dests = {}
        for flag, knob in flags.items():
            if flag not in self.options:  # the data file and this table disagree: a bug, not bad input
                raise RuntimeError(f"{flag} is not a `vllm serve` flag in {DATA_FILE.name} (vLLM "
                                   f"{self.vllm_version}); update {name}")
            dests[self.options[flag].dest] = knob
        return dests


def _table_from(doc: dict[str, Any]) -> FlagTable:
    options = {name: Option(name, str(o["dest"]), o.get("nargs")) for name, o in doc["options"].items()}
    return FlagTable(str(doc["vllm_version"]), options)


@cache
def flag_table() -> FlagTable:
    return _table_from(json.loads(DATA_FILE.read_text()))


def names_a_secret_flag(text: str, table: FlagTable | None = None) -> bool:
    """Might `text` (VLLM_EXTRA_ARGS as written, split or not) hold a flag whose value is a secret: any
    word that is, or is a prefix of, such a flag, in any case? Then the text is never shown."""
    table = table or flag_table()
    secret = table.secret_dests()
    return any(o.dest in secret for m in _FLAG_WORD.finditer(text)
               for o in table.resolve(m.group(1).lower().split(".", 1)[0]))


def secret_flag_refusal(words: list[str], table: FlagTable | None = None) -> str | None:
    """The refusal (as check_extra_words words it) of the first flag word that sets a secret, else None."""
    table = table or flag_table()
    secrets = table.secret_dests()
    for word in words:
        base = word.split("=", 1)[0].split(".", 1)[0]
        matches = table.resolve(base) if word.startswith("--") else []
        secret = sorted(o.dest for o in matches if o.dest in secrets)
        if secret:
            return (f"has {base}{_alias(base, matches, secret[0])}: its value is a secret, which on a command line "
                    "`ps`, `docker inspect`, `config`, the history and the systemd unit would show; set "
                    f"{secrets[secret[0]]} in the env file instead (it reaches the containers in a 0600 file)")
    return None


def check_extra_words(words: list[str], table: FlagTable | None = None) -> None:
    """Raise ValueError (one line: the word, what vLLM would do, what to do) for the first word vLLM
    would take differently from what the user meant, or that would override what sparkctl sets.

    `words` start with a flag; every flag is a `--long-name` or `--long-name=value` (the caller checked
    the spelling). A `--name.key` word is vLLM's dotted JSON form of `--name` and counts as `--name`.
    """
    table = table or flag_table()
    owned = table.owned_dests()
    expect: int | str | None = 0  # how many more value words the last flag takes
    last = ""
    last_nargs: int | str | None = None
    for word in words:
        if not word.startswith("-"):
            if expect == 0:
                takes = "no value" if last_nargs == 0 else "one value"
                raise ValueError(f"has the value {word!r} after {last}, which takes {takes}: vLLM would read it "
                                 "as a second model and refuse to start")
            if expect is None or expect == "?":
                expect = 0
            continue
        flag = word.split("=", 1)[0]
        base = flag.split(".", 1)[0]  # --speculative-config.method=mtp sets --speculative-config
        matches = table.resolve(base)
        if not matches:
            near = difflib.get_close_matches(base, [n for n in table.options if n.startswith("--")], n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ValueError(f"has {base}, which `vllm serve` {table.vllm_version} does not have (vLLM would "
                             f"refuse to start: unrecognized arguments){hint}")
        dests = {o.dest for o in matches}
        hit = sorted(d for d in dests if d in owned)
        if hit:
            raise ValueError(f"has {base}{_alias(base, matches, hit[0])}: sparkctl sets {_canonical(table, hit[0])} "
                             f"from {owned[hit[0]]}; set that instead")
        refusal = secret_flag_refusal([word], table)
        if refusal:
            raise ValueError(refusal)
        if len(dests) > 1:
            cands = ", ".join(sorted(o.name for o in matches)[:6])
            raise ValueError(f"has {base}, which is ambiguous to vLLM ({cands}); write the full flag name")
        opt = matches[0]
        last = opt.name if base == opt.name else f"{base} ({opt.name})"
        last_nargs = opt.nargs
        expect = 0 if "=" in word else (None if "." in flag else opt.nargs)


def _alias(base: str, matches: list[Option], dest: str) -> str:
    """"" when `base` is the option's own name, else how vLLM takes it."""
    names = sorted(o.name for o in matches if o.dest == dest)
    return "" if base in names else f" (vLLM takes it as {names[0] if len(names) == 1 else ' or '.join(names)})"


def _canonical(table: FlagTable, dest: str) -> str:
    for flag in OWNED_FLAGS:
        if table.options.get(flag) and table.options[flag].dest == dest:
            return flag
    return dest
