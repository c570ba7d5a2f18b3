"""The supervisor's policy (fake world), the state file, history/rollback selection, the systemd unit."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import UsageError
from sparkctl.remote.releases import Release, hash_tag, parse_history, pick, rollback_overrides
from sparkctl.remote.watchstate import describe, parse_state
from sparkctl.rules.supervisor import Budget, Observation, Policy, Supervisor, diagnose
from sparkctl.spec.systemd_unit import exec_line, unit_text, unquote_exec

NODES = ["n1", "n2", "n3", "n4"]
UP = {r: "running" for r in range(4)}


class FakeWorld:
    """Plays back observations; records what the supervisor did."""

    def __init__(self, script: list[Observation], *, restart_ok: bool = True, down_after: int | None = None,
                 busy_rounds: int = 0) -> None:
        self.nodes = NODES
        self.script = script
        self.restart_ok = restart_ok
        self.down_after = down_after
        self.busy_rounds = busy_rounds
        self.rounds = 0
        self.restarts: list[tuple[str, int]] = []
        self.gave_up: list[str] = []
        self.published: list[dict[str, Any]] = []
        self.canaries: list[bool] = []

    def observe(self, canary: bool) -> Observation:
        self.canaries.append(canary)
        obs = self.script[min(self.rounds, len(self.script) - 1)]
        self.rounds += 1
        return obs

    def deliberate_stop(self) -> str | None:
        return "`down` by alice" if self.down_after is not None and self.rounds >= self.down_after else None

    def busy(self) -> str | None:
        if self.busy_rounds:
            self.busy_rounds -= 1
            return "bob running `up`"
        return None

    def restart(self, reason: str, attempt: int) -> None:
        self.restarts.append((reason, attempt))
        if not self.restart_ok:
            raise RuntimeError("rank 1 died during load")

    def give_up(self, reason: str) -> None:
        self.gave_up.append(reason)

    def publish(self, doc: dict[str, Any]) -> None:
        self.published.append(doc)

    def say(self, text: str) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def run(world: FakeWorld, policy: Policy, rounds: int) -> tuple[int, Supervisor, Clock]:
    clock = Clock()
    sup = Supervisor(world, policy, clock=clock, sleep=clock.sleep, max_rounds=rounds)
    return sup.run(), sup, clock


POLICY = Policy(interval_s=5, canary_every_s=30, max_restarts=3, window_s=600, backoff_s=10, node_wait_s=60)


def test_a_dead_rank_restarts_the_group_at_once_and_then_it_watches():
    dead = Observation({**UP, 2: "exited (exit 137)"}, health=200)
    world = FakeWorld([Observation(dict(UP), health=200), dead, Observation(dict(UP), health=200)])
    code, sup, clock = run(world, dataclasses.replace(POLICY, backoff_s=7), 3)
    assert code == 0 and len(world.restarts) == 1
    reason, attempt = world.restarts[0]
    assert "rank 2 (n3) exited (exit 137)" in reason and attempt == 1
    assert set(clock.slept) == {POLICY.interval_s}  # the first restart waits no backoff
    assert world.published[-1]["state"] == "watching" and world.published[-1]["restarts"] == 1


def test_restarts_back_off_then_the_budget_ends_it_down_and_non_zero():
    dead = Observation({**UP, 1: "absent"}, health=None)
    world = FakeWorld([dead], restart_ok=False)
    code, sup, clock = run(world, POLICY, 20)
    assert code == 1
    assert [a for _, a in world.restarts] == [1, 2, 3]  # exactly max_restarts attempts
    assert [s for s in clock.slept if s != POLICY.interval_s] == [10, 20]  # exponential backoff
    assert len(world.gave_up) == 1 and "3 restarts within 600s" in world.gave_up[0]
    assert world.published[-1]["state"] == "gave-up"


def test_the_budget_counts_only_the_window():
    b = Budget(Policy(max_restarts=2, window_s=100, backoff_s=5))
    assert b.allows(0) and b.delay(0) == 0
    b.spend(0)
    assert b.delay(1) == 5
    b.spend(1)
    assert not b.allows(50)
    assert b.allows(101.5) and b.delay(101.5) == 0


def test_an_unreachable_node_is_waited_for_then_the_group_restarts_when_it_is_back():
    gone = Observation({0: "running", 1: "running", 3: "running"}, unreachable={"n3": "connection refused"})
    back = Observation({**UP, 2: "absent"}, health=503)
    world = FakeWorld([gone, gone, gone, back, Observation(dict(UP), health=200)])
    code, sup, clock = run(world, POLICY, 5)
    assert code == 0
    assert len(world.restarts) == 1 and "node back after 15s" in world.restarts[0][0]
    assert any(p["state"] == "waiting-for-node" for p in world.published)


def test_a_node_gone_past_the_bound_ends_it_non_zero():
    gone = Observation({0: "running"}, unreachable={"n2": "timed out"})
    world = FakeWorld([gone])
    code, sup, clock = run(world, POLICY, 30)
    assert code == 1 and not world.restarts and world.gave_up and "WATCH_NODE_WAIT_S" in world.gave_up[0]


def test_a_deliberate_down_ends_it_with_zero_and_no_restart():
    world = FakeWorld([Observation(dict(UP), health=200), Observation({r: "absent" for r in UP})], down_after=2)
    code, sup, clock = run(world, POLICY, 10)
    assert code == 0 and not world.restarts and not world.gave_up
    assert world.published[-1]["state"] == "stopped" and "alice" in world.published[-1]["detail"]


def test_another_commands_lock_pauses_it():
    world = FakeWorld([Observation({r: "absent" for r in UP})], busy_rounds=2)
    code, sup, clock = run(world, POLICY, 2)
    assert not world.restarts and world.published[-1]["state"] == "lock-held-by-another-command"


def test_hung_head_and_health_blips():
    p = Policy()
    hung = Observation(dict(UP), health=200, canary="ReadTimeout within 30s")
    assert "head hung" in (diagnose(hung, NODES, 0, p) or "")
    blip = Observation(dict(UP), health=None)
    assert diagnose(blip, NODES, 1, p) is None  # one bad answer can be a blip
    assert "2 times in a row" in (diagnose(blip, NODES, 2, p) or "")
    assert diagnose(Observation(dict(UP), health=200, canary="ok"), NODES, 0, p) is None


def test_the_canary_runs_at_its_own_slower_period():
    world = FakeWorld([Observation(dict(UP), health=200, canary="ok")])
    run(world, Policy(interval_s=5, canary_every_s=20), 9)
    assert world.canaries == [True, False, False, False, True, False, False, False, True]


# ------------------------------------------------------------------------------------- state file


def test_state_file_is_read_as_untrusted_and_staleness_shows():
    doc = {"state": "watching", "detail": "", "who": "root@h", "since": "x", "updated": "t", "updated_epoch": 100.0,
           "interval_s": 5, "restarts": 2, "restarts_in_window": 1, "max_restarts": 3, "pid": 7}
    st = parse_state(json.dumps(doc), now=110)
    assert st and st["alive"] and st["restarts"] == 2
    assert "watching" in describe(st) and "2 restart(s)" in describe(st)
    stale = parse_state(json.dumps(doc), now=200)
    assert stale and not stale["alive"] and "not running" in describe(stale)
    for junk in ["", "[]", "{", '{"state": 3}', "x" * 100000, json.dumps({**doc, "pid": "7; rm -rf /",
                                                                          "updated_epoch": True})]:
        got = parse_state(junk, now=110)
        assert got is None or (got["pid"] is None and not got["alive"])
    assert "none has run" in describe(None)


# ---------------------------------------------------------------------------------- history, rollback


def entry(n: int, **kw: Any) -> dict[str, Any]:
    d = {"when": f"2026-12-01T00:0{n}:00Z", "who": "root@x", "source": "sparkctl up", "config_hash": f"cfg{n}" * 2,
         "image": "sparkctl-lab/chain:keys3", "image_content_hash": f"{n}" * 64, "knobs": {"PORT": "8888"}}
    return {**d, **kw}


def test_history_parse_newest_first_and_junk_skipped():
    text = "\n".join([json.dumps(entry(1)), "garbage", json.dumps({"when": 1}), "[]", json.dumps(entry(2)),
                      json.dumps(entry(3, knobs={"PORT": "1", "HF_TOKEN": "s3cret", "NOPE": "x",
                                                 "STANDIN_TTFT_S": "0.1", "CONTAINER_ENV_PREFIXES": "STANDIN_"})),
                      json.dumps(entry(4, knobs={"PORT": "2", "STANDIN_TTFT_S": "0.1"}))])
    rs = parse_history(text)
    assert [r.config_hash for r in rs] == ["cfg4cfg4", "cfg3cfg3", "cfg2cfg2", "cfg1cfg1"]
    assert [r.n for r in rs] == [1, 2, 3, 4]
    # no secret, no unknown key; a passed-through key only in a family its release declared
    assert rs[1].knobs == {"PORT": "1", "STANDIN_TTFT_S": "0.1", "CONTAINER_ENV_PREFIXES": "STANDIN_"}
    assert rs[0].knobs == {"PORT": "2"}


def test_pick_default_number_and_hash():
    rs = parse_history("\n".join(json.dumps(entry(i)) for i in (1, 2, 3)))
    assert pick(rs, None).config_hash == "cfg2cfg2"  # the one before the newest
    again = parse_history("\n".join(json.dumps(entry(i)) for i in (1, 2, 3, 3, 3)))  # watch restarts repeat 3
    assert pick(again, None).config_hash == "cfg2cfg2"
    assert pick(rs, "3").config_hash == "cfg1cfg1"
    assert pick(rs, "111111").config_hash == "cfg1cfg1"  # by content hash prefix
    for bad in ["0", "4", "zz;rm", "abcdef0", "abc"]:
        with pytest.raises(UsageError):
            pick(rs, bad)
    with pytest.raises(UsageError):
        pick(rs[:1], None)


def test_rollback_pins_the_image_by_content_hash():
    r = Release(1, "w", "who", "up", "cfg", "sparkctl-lab/chain:keys3", "ab" * 32, {"PORT": "1"})
    assert rollback_overrides(r) == {"PORT": "1", "IMAGE": "sparkctl-lab/chain:keys3-" + "ab" * 6}
    assert rollback_overrides(r, "cd" * 32)["IMAGE"] == "sparkctl-lab/chain:keys3-" + "ab" * 6  # tag moved
    assert rollback_overrides(r, "ab" * 32)["IMAGE"] == "sparkctl-lab/chain:keys3"  # still that image
    assert hash_tag("reg:5000/chain", "cd" * 32) == "reg:5000/chain:latest-" + "cd" * 6
    assert hash_tag("a/b:keys3-" + "ab" * 6, "ab" * 32) == "a/b:keys3-" + "ab" * 6  # already pinned


# ----------------------------------------------------------------------------------------- systemd


def unit(argv: list[str]) -> str:
    return unit_text(cluster="c1", argv=argv, env={"SPARKCTL_SSH_CONFIG": "/etc/ssh x/config", "PORT": "8%8$8"})


def test_exec_start_words_survive_systemd_quoting():
    argv = [sys.executable, "-m", "sparkctl", "--env-file", '/srv/my env/"x"$HOME%i\\.env', "watch"]
    line = exec_line(argv)
    assert "$$HOME" in line and "%%i" in line
    assert unquote_exec(line) == argv
    with pytest.raises(UsageError):
        exec_line(["a\nExecStartPre=/bin/evil"])


def test_unit_is_bounded_and_ordered_after_docker_and_network():
    text = unit([sys.executable, "-m", "sparkctl", "watch"])
    for line in ["After=network-online.target docker.service", "Restart=on-failure", "StartLimitBurst=3",
                 "StartLimitIntervalSec=3600", "WantedBy=multi-user.target", "RestartSec=30",
                 "Description=sparkctl supervisor for cluster c1", 'Environment="PORT=8%%8$8"']:
        assert line in text.splitlines(), line


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    path = tmp_path / "sparkctl-watch-c1.service"
    path.write_text(unit([sys.executable, "-m", "sparkctl", "--env-file", str(tmp_path / "a b.env"), "watch"]))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True,
                       timeout=60)
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "sparkctl-watch-c1" in ln]
    assert not complaints, r.stdout + r.stderr


def test_status_view_shows_ranks_metrics_supervisor_and_problems():
    from rich.console import Console

    from sparkctl.commands.lifecycle import _status_view

    doc = {"cluster": "c1", "ranks": [{"rank": 0, "node": "n1", "state": "running", "uptime_s": 5, "restarts": 0,
                                       "image_id": "sha256:0123456789abcdef", "config_hash": "cfg"},
                                      {"rank": 1, "node": "n2", "state": "absent"}],
           "head": {"url": "http://h:1", "health": 200, "models": ["m"],
                    "metrics": {"requests_running": 2.0, "tokens_per_s": 41.5}},
           "supervisor": {"state": "restarting", "detail": "attempt 1/3: rank 1 (n2) absent", "alive": True,
                          "pid": 9, "who": "root@h", "age_s": 0.4, "restarts": 1, "restarts_in_window": 1,
                          "max_restarts": 3},
           "problems": ["rank 1 (n2): no container"]}
    con = Console(record=True, width=200)
    con.print(_status_view(doc))
    text = con.export_text()
    for want in ["cluster c1", "n2", "absent", "requests_running 2", "tokens_per_s 41.5",
                 "supervisor: restarting (attempt 1/3: rank 1 (n2) absent)", "1/3 in the window",
                 "✗ rank 1 (n2): no container"]:
        assert want in text, want


def test_export_systemd_print_leaves_secrets_from_the_environment_out_and_warns(monkeypatch, capsys, tmp_path):
    """README: secrets are never written into the unit (the install writes it world-readable). A secret
    set in the environment is left out, with a warning naming it; the other knobs there are pinned."""
    from tests.conftest import run_cli

    monkeypatch.chdir(tmp_path)
    for k in ("SPARKCTL_ENV_FILE", "TP", "DCP"):
        monkeypatch.delenv(k, raising=False)
    secrets = {"HF_TOKEN": "hf_UNITzq81vXsecret", "VLLM_API_KEY": "sk-UNITm2Pq9wsecret"}
    env = {"NODES": "n1 n2 n3 n4", "MODEL": str(tmp_path / "model"), "RECIPE": "lab", "CLUSTER_NAME": "u",
           "PORT": "8123", **secrets}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for argv in (["export", "systemd", "--print"], ["--json", "export", "systemd", "--print"]):
        code, out, err = run_cli(argv, capsys)
        assert code == 0, err
        text = json.loads(out)["text"] if "--json" in argv else out
        envs = [ln for ln in text.splitlines() if ln.startswith("Environment=")]
        # exactly what came from the environment, less RECIPE (ExecStart's --recipe) and the secrets
        pinned = sorted(ln.split("=", 2)[1].lstrip('"') for ln in envs)
        assert pinned == ["CLUSTER_NAME", "MODEL", "NODES", "PORT"], envs
        assert 'Environment="PORT=8123"' in envs and 'Environment="CLUSTER_NAME=u"' in envs, envs
        for key, value in secrets.items():
            assert value not in out + err, f"{key}'s value was printed"
            assert not any(key in ln for ln in envs), envs
            assert f"{key} comes from the environment" in err and "not written into the unit" in err, err


def test_the_state_is_replaced_only_by_a_whole_document_and_writers_do_not_share_a_temporary(tmp_path: Path) -> None:
    """A write whose input was cut short (the sender interrupted) keeps the last whole state, never an
    empty watch.json; two writers at once each use their own temporary file."""

    from sparkctl.remote.watchstate import _WRITE

    f = tmp_path / "t" / "watch.json"

    def write(data: bytes) -> int:
        return subprocess.run(["sh", "-c", _WRITE, "w", str(f)], input=data, timeout=10).returncode

    assert write(b'{"state": "watching"}') == 0
    assert write(b"") == 1 and f.read_text() == '{"state": "watching"}'
    assert write(b'{"state": "sto') == 1 and f.read_text() == '{"state": "watching"}'
    assert sorted(p.name for p in f.parent.iterdir()) == ["watch.json"]  # no temporary left behind
    assert '"$f.tmp.$$"' in _WRITE or 't="$f.tmp.$$"' in _WRITE  # one temporary per writing shell
