"""One endpoint over the replicas: the nginx.conf `sparkctl endpoint` renders.

What it says (least_conn over every head, streaming unbuffered, long read timeouts, Authorization passed
through), that no value can inject nginx syntax, which heads it takes from the settings, and the command
as a user runs it. The real nginx judges the text: tests/unit/spec/test_nginx_conf_real_nginx.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkctl.errors import UsageError
from sparkctl.spec.nginx_conf import heads_of, nginx_config, nginx_host, upstream_name
from tests.conftest import run_cli as run


def _directives(conf: str) -> list[str]:
    """The config's statements, comments dropped, whitespace folded."""
    text = "\n".join(line.split("#", 1)[0] for line in conf.splitlines())
    return [" ".join(s.split()) for s in re.split(r"[;{}]", text) if s.strip()]


def test_the_config_balances_least_conn_over_every_head_and_streams_unbuffered() -> None:
    conf = nginx_config([("10.0.0.1", 8888), ("spark2.lan", 8000), ("fd00::2", 8888)], listen=9000,
                        api_key_set=True, cluster="prod-a")
    d = _directives(conf)
    assert "upstream sparkctl_prod_a" in d and "least_conn" in d and "zone sparkctl_prod_a 64k" in d
    servers = [x for x in d if x.startswith("server ")]
    assert servers == ["server 10.0.0.1:8888 max_fails=3 fail_timeout=30s",
                       "server spark2.lan:8000 max_fails=3 fail_timeout=30s",
                       "server [fd00::2]:8888 max_fails=3 fail_timeout=30s"]
    assert d.index("least_conn") < d.index("keepalive 32")  # nginx: the balancer before keepalive
    for want in ("listen 9000", "proxy_pass http://sparkctl_prod_a", "proxy_http_version 1.1",
                 'proxy_set_header Connection ""', "proxy_buffering off", "proxy_request_buffering off",
                 "proxy_read_timeout 3600s", "proxy_send_timeout 3600s", "proxy_next_upstream error timeout"):
        assert want in d, want
    # Authorization passes through unchanged: nothing sets or clears it
    assert not [x for x in d if "authorization" in x.lower()]
    assert conf.startswith("# nginx.conf") and d[-1] == "proxy_next_upstream error timeout"


def test_listen_host_state_dir_and_the_api_key_note() -> None:
    conf = nginx_config([("h1", 1)], listen=80, api_key_set=False, listen_host="::1", state_dir="/srv/ngx/")
    d = _directives(conf)
    assert "listen [::1]:80" in d and "pid /srv/ngx/nginx.pid" in d and "proxy_temp_path /srv/ngx/proxy" in d
    assert "none is set" in conf and "answer anyone" in conf
    plain = nginx_config([("h1", 1)], listen=80, api_key_set=True)
    assert "pid" not in " ".join(_directives(plain)) and "Authorization: Bearer" in plain


HOSTILE_HOSTS = ["a;b", "evil{", "h}", "x\nproxy_pass http://e", "#c", "a b", "", "a\tb", "$host", "'q'", '"q"',
                 "h:80", "-x", "a..b", "1.2.3.999", "[1.2.3.4]", "fe80::1%eth0", "[::1", "x" * 64, "a/b",
                 "127.0.0.1:1 down; server 6.6.6.6", "h\x00", "ünï", 123, None, b"h"]


@pytest.mark.parametrize("host", HOSTILE_HOSTS, ids=repr)
def test_a_hostile_host_is_refused(host: Any) -> None:
    with pytest.raises(UsageError):
        nginx_config([(host, 8888)], listen=9000, api_key_set=True)
    if host is not None:  # listen_host=None: every address
        with pytest.raises(UsageError):
            nginx_config([("ok", 8888)], listen=9000, api_key_set=True, listen_host=host)


@pytest.mark.parametrize("port", ["8888", "80;", 8888.0, True, 0, -1, 65536, None], ids=repr)
def test_a_port_is_an_int_in_range(port: Any) -> None:
    with pytest.raises(UsageError):
        nginx_config([("h", port)], listen=9000, api_key_set=True)
    with pytest.raises(UsageError):
        nginx_config([("h", 8888)], listen=port, api_key_set=True)


@pytest.mark.parametrize("kwargs", [{"cluster": "a;b"}, {"cluster": "A"}, {"cluster": ""},
                                    {"state_dir": "rel/dir"}, {"state_dir": "/a b"}, {"state_dir": "/a;b"},
                                    {"state_dir": "/a/../etc"}, {"max_fails": "3"}, {"read_timeout_s": 0}])
def test_every_other_value_is_checked(kwargs: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        nginx_config([("h", 1)], listen=2, api_key_set=True, **kwargs)


def test_no_heads_twice_the_same_head_or_a_bare_string_is_refused() -> None:
    for heads in ([], [("h", 1), ("h", 1)], "h:1", [("h",)], [("h", 1, 2)]):
        with pytest.raises(UsageError):
            nginx_config(heads, listen=2, api_key_set=True)  # type: ignore[arg-type]


def test_hosts_in_their_nginx_form() -> None:
    assert nginx_host("::1") == nginx_host("[::1]") == "[::1]"
    assert nginx_host("[FD00:0::2]") == "[fd00::2]"
    assert nginx_host("10.0.0.1") == "10.0.0.1" and nginx_host("spark-1.lab.") == "spark-1.lab."
    assert upstream_name("my.cluster-1") == "sparkctl_my_cluster_1"


_SERVER_LINE = re.compile(r"        server (?:[A-Za-z0-9_.-]+|\[[0-9a-f:.]+\]):8888 max_fails=3 fail_timeout=30s;")


@settings(max_examples=300)
@given(host=st.text(st.characters(codec="utf-8"), max_size=40)
       | st.from_regex(r"[a-z0-9.:\[\]; {}#\n-]{1,20}", fullmatch=True))
def test_any_host_is_refused_or_becomes_one_plain_server_line(host: str) -> None:
    """Whatever text a HostName holds: a UsageError, or exactly one `server` line in the plain form and
    the same statements as a harmless host gives (no directive, block or comment added)."""
    try:
        conf = nginx_config([(host, 8888)], listen=9000, api_key_set=True)
    except UsageError:
        return
    servers = [ln for ln in conf.splitlines() if ln.startswith("        server ")]  # the upstream's
    assert len(servers) == 1 and _SERVER_LINE.fullmatch(servers[0]), servers
    same_shape = nginx_config([("h", 8888)], listen=9000, api_key_set=True)
    assert len(_directives(conf)) == len(_directives(same_shape))
    assert conf.count("{") == same_shape.count("{") and conf.count("}") == same_shape.count("}")


# -- which heads


def _settings(nodes: list[str], port: int = 8888) -> Any:
    from sparkctl.spec.settings import load_settings

    return load_settings(cli={}, environ={"NODES": " ".join(nodes), "MODEL": "/models/m", "RECIPE": "lab",
                                          "PORT": str(port), "TP": "2", "DCP": "2"})


def test_heads_of_one_replica_is_the_head_on_port_as_resolved(clean_env: Any) -> None:
    seen: list[str] = []

    def resolve(alias: str) -> str:
        seen.append(alias)
        return {"spark1": "10.0.0.11"}[alias]

    assert heads_of(_settings(["spark1", "spark2"]), resolve) == [("10.0.0.11", 8888)]
    assert seen == ["spark1"]  # the head only: workers serve no API


def test_heads_of_replicas_is_each_replicas_head(clean_env: Any) -> None:
    """The real topology: 6 nodes at TP=2 are 3 replicas, headed by the 1st, 3rd and 5th node."""
    nodes = ["a1", "a2", "b1", "b2", "c1", "c2"]
    assert heads_of(_settings(nodes, port=9001), lambda a: a + ".lan") == [
        ("a1.lan", 9001), ("b1.lan", 9001), ("c1.lan", 9001)]


# -- the command


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.chdir(tmp_path)
    for k in ("SPARKCTL_ENV_FILE", "VLLM_API_KEY", "HF_TOKEN", "PORT", "SPARKCTL_SSH_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    for k, v in {"NODES": "spark1 spark2 spark3 spark4", "MODEL": str(model), "RECIPE": "lab", "CLUSTER_NAME": "blue",
                 "VLLM_API_KEY": "sk-endpoint-secret-4711"}.items():
        monkeypatch.setenv(k, v)
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host spark1\n  HostName 10.9.8.7\nHost spark2\n  HostName 10.9.8.8\n"
                   "Host evil\n  HostName 10.9.8.7;}\n")
    return cfg


def test_endpoint_writes_the_config_for_the_heads_address_without_the_key(cli_env: Path, capsys: Any) -> None:
    code, out, err = run(["--ssh-config", str(cli_env), "endpoint", "--print", "--listen", "9000"], capsys)
    assert code == 0, err
    conf = Path("env/nginx.conf").read_text()
    assert out.strip() == conf.strip()
    d = _directives(conf)
    assert [x for x in d if x.startswith("server ")] == ["server 10.9.8.7:8888 max_fails=3 fail_timeout=30s"]
    assert "upstream sparkctl_blue" in d and "listen 9000" in d and "the heads check it" in conf
    assert "sk-endpoint-secret-4711" not in out + err + conf
    assert "wrote env/nginx.conf" in err


def test_endpoint_json_and_defaults(cli_env: Path, capsys: Any) -> None:
    code, out, err = run(["--ssh-config", str(cli_env), "--json", "endpoint", "--out", "x/ngx.conf",
                          "--bind", "127.0.0.1", "--state-dir", "run"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc == {"nginx_conf": "x/ngx.conf", "heads": [{"node": "spark1", "host": "10.9.8.7", "port": 8888}],
                   "listen": "127.0.0.1:8888", "api_key_set": True, "state_dir": str(Path("run").resolve())}
    assert "sk-endpoint-secret-4711" not in out + err + Path("x/ngx.conf").read_text()
    assert Path("run").is_dir()
    code, out, err = run(["--ssh-config", str(cli_env), "endpoint", "--state-dir", "run"], capsys)
    assert code == 0 and f"-e {Path('run').resolve()}/error.log" in out


def test_endpoint_refuses_a_hostile_value_with_exit_2(cli_env: Path, capsys: Any, monkeypatch: Any) -> None:
    code, out, err = run(["--ssh-config", str(cli_env), "endpoint", "--bind", "0.0.0.0;x"], capsys)
    assert code == 2 and "listen host" in err and not Path("env/nginx.conf").exists()
    monkeypatch.setenv("NODES", "evil spark2 spark3 spark4")
    code, out, err = run(["--ssh-config", str(cli_env), "endpoint"], capsys)
    assert code == 2 and "10.9.8.7;}" in err and not Path("env/nginx.conf").exists()


def test_endpoint_warns_when_no_api_key_guards_an_open_listen(cli_env: Path, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("VLLM_API_KEY")
    code, out, err = run(["--ssh-config", str(cli_env), "endpoint"], capsys)
    assert code == 0 and "VLLM_API_KEY" in err and "every address" in err
    code, out, err = run(["--ssh-config", str(cli_env), "endpoint", "--bind", "127.0.0.1"], capsys)
    assert code == 0 and "VLLM_API_KEY" not in err
