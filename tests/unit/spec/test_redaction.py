"""The one redaction of diagnose's bundle: the settings' secret values anywhere, and anything shaped like a
credential (tokens, Bearer, a secret-named key's value, --api-key's argument); useful values stay."""

from __future__ import annotations

import pytest

from sparkctl.spec.redaction import redact, redact_bytes
from sparkctl.spec.settings import REDACTED


@pytest.mark.parametrize("text, secret", [
    ("HF_TOKEN=hf_abcdefghijklmnopqrstuv", "hf_abcdefghijklmnopqrstuv"),
    ('"Env": ["VLLM_API_KEY=opensesame1"]', "opensesame1"),
    ('{"api_key": "zzz-secret-zzz"}', "zzz-secret-zzz"),
    ("vllm serve /m --api-key letmein123 --port 8000", "letmein123"),
    ("--hf-token=hfvalue99", "hfvalue99"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload", "eyJhbGciOiJIUzI1NiJ9.payload"),
    ("downloading with hf_QWERTYUIOPASDFGHJKLZ in the url", "hf_QWERTYUIOPASDFGHJKLZ"),
    ("key sk-proj-ABCDEFGHIJKLMNOP1234 used", "sk-proj-ABCDEFGHIJKLMNOP1234"),
    ("GET /x?token=AAAABBBBCCCCDDDDEEEEFFFF", "AAAABBBBCCCCDDDDEEEEFFFF"),
    ("DB_PASSWORD: hunter22", "hunter22"),
    ("ghp_abcdefghijklmnopqrstuvwxyz0123 pushed", "ghp_abcdefghijklmnopqrstuvwxyz0123"),
])
def test_credential_shapes_are_redacted(text: str, secret: str) -> None:
    out = redact(text)
    assert secret not in out and REDACTED in out, out


def test_the_settings_secret_values_are_redacted_anywhere() -> None:
    out = redact("the engine said: loaded plain-word-secret ok", ["plain-word-secret"])
    assert out == f"the engine said: loaded {REDACTED} ok"
    assert redact_bytes(b"x plain-word-secret \xff", ["plain-word-secret"]) == f"x {REDACTED} \\xff".encode()


def test_useful_values_stay() -> None:
    text = ("--max-num-batched-tokens 8192 max_tokens=256 NCCL_IB_HCA=rocep1s0f0 "
            "image sha256:" + "a" * 64 + " KEY_FILE=/etc/k.pem")
    assert redact(text) == text


def test_a_json_document_stays_valid_and_keeps_its_figures_under_secret_named_keys() -> None:
    """check --json's plan has kv_bytes_per_token (a figure under a key ending in "token"): the redacted
    document still parses and keeps it, while a secret-named key's string value and a long numeric token
    are redacted."""
    import json

    doc = {"kv_bytes_per_token": 656, "kv_terms": [1, 2], "auth": {"x": 1}, "use_token": True,
           "api_key": "abcd1234efgh5678", "HF_TOKEN": "123456789012345678901234"}
    out = redact(json.dumps(doc, indent=1))
    back = json.loads(out)
    assert back["kv_bytes_per_token"] == 656 and back["kv_terms"] == [1, 2] and back["use_token"] is True
    assert back["api_key"] == REDACTED and back["HF_TOKEN"] == REDACTED
