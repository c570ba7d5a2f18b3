"""The ranks' state from `docker inspect`'s whole JSON (nothing of Config.Env), and the diagnose probe's
log section split per container."""

from __future__ import annotations

import json

import pytest

from sparkctl.facts import inspect_raw
from sparkctl.facts.parsing import ParseError


def test_rank_summaries_read_state_and_never_env() -> None:
    doc = [{"Id": "c" * 64, "Name": "/sparkctl-t-rank1", "RestartCount": 0,
            "Config": {"Labels": {"sparkctl.rank": "1"}, "Image": "img", "Env": ["HF_TOKEN=hf_nope"]},
            "State": {"Status": "exited", "ExitCode": 137, "OOMKilled": True, "FinishedAt": "2026-01-01T00:00:00Z"}}]
    got = inspect_raw.rank_summaries(json.dumps(doc))
    assert got[0]["rank"] == "1" and got[0]["exit_code"] == 137 and got[0]["oom_killed"] is True
    assert got[0]["name"] == "sparkctl-t-rank1" and "hf_nope" not in repr(got)
    assert inspect_raw.rank_summaries("") == []
    with pytest.raises(ParseError):
        inspect_raw.rank_summaries('{"not": "a list"}')


def test_split_logs_per_container() -> None:
    text = f"@@container {'a' * 64}\nline 1\nline 2\n@@container {'b' * 64}\nother\n"
    assert inspect_raw.split_logs(text) == {"a" * 64: "line 1\nline 2\n", "b" * 64: "other\n"}
    assert inspect_raw.split_logs("stray line\n") == {}
