"""The one redaction every file of a `sparkctl diagnose` bundle goes through before it is archived.

Two passes, on any text (a log, an argv, `docker inspect`, an env file, the audit):
1. every value the settings call secret (keys matching TOKEN/KEY/SECRET/PASSWORD: `Settings.secrets()`),
   wherever it appears, verbatim;
2. anything that looks like a credential: `hf_…` and `sk-…` tokens, `Bearer …`, GitHub and AWS key
   shapes, the value after a secret-named key (`HF_TOKEN=…`, `"api_key": "…"`, `--api-key …`,
   `password: …`), and a long base64/hex run after `key=`/`token=`-like words.
Each is replaced by REDACTED; the rest of the line is kept, so the bundle still shows which setting
carried a secret. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from .settings import REDACTED

# A key that names a secret ends with the word (HF_TOKEN, api_key, db-password; not max_tokens, KEY_FILE).
_WORD: Final = r"[A-Za-z0-9_.-]*(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?|AUTH)"

PATTERNS: Final[tuple[re.Pattern[str], ...]] = (
    # KEY=value, KEY: value, "key": "value", 'key'='value' (an env file, docker inspect's Env, JSON, YAML)
    re.compile(rf"""(?i)(["']?\b{_WORD}["']?\s*[=:]\s*["']?)([^\s"',;&]+)"""),
    # --api-key VALUE, --hf-token=VALUE (an argv)
    re.compile(r"(?i)(--[a-z0-9-]*(?:key|token|secret|password)(?:=|\s+))([^\s\"',;&]+)"),
    re.compile(r"(?i)(\bBearer\s+)([A-Za-z0-9._~+/=-]{8,})"),
    re.compile(r"(?i)(\bBasic\s+)([A-Za-z0-9+/=]{8,})"),
    re.compile(r"()\bhf_[A-Za-z0-9]{16,}"),
    re.compile(r"()\bsk-[A-Za-z0-9_-]{16,}"),
    re.compile(r"()\bgh[pousr]_[A-Za-z0-9]{20,}"),
    re.compile(r"()\bAKIA[0-9A-Z]{16}\b"),
    # a long base64/hex run after a key/token-like word (auth=…, sig=…, credential=…)
    re.compile(r"(?i)(\b(?:key|token|secret|auth|sig|signature|credential|password)\w*[=:]\s*)([A-Za-z0-9+/_=-]{20,})"),
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """TEXT with every secret value and everything that looks like a token replaced by REDACTED."""
    for value in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    for pat in PATTERNS:
        text = pat.sub(_replace, text)
    return text


# What a secret-named key may carry that is no secret and that JSON needs kept: a number (kv_bytes_per_token:
# 656), a literal, or the opening of a nested value. Redacting these would hide figures and break the document.
_NOT_SECRET: Final = re.compile(r"(?i)-?[0-9]{1,12}(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?|true|false|null|none|[\[{]")


def _replace(m: re.Match[str]) -> str:
    value = m.group(2) if m.re.groups >= 2 else ""
    if value and _NOT_SECRET.fullmatch(value):
        return m.group(0)
    return m.group(1) + REDACTED


def redact_bytes(data: bytes, secrets: Iterable[str] = ()) -> bytes:
    """redact() on bytes (decoded as UTF-8, undecodable bytes kept as escapes)."""
    return redact(data.decode("utf-8", errors="backslashreplace"), secrets).encode()
