"""Shell completion of values, through click's real protocol (`_SPARKCTL_COMPLETE=bash_complete` in a
`python -m sparkctl` process, as bash runs it): node names, image layers, ranks. Offline, silent, never
an error."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from sparkctl.completion import ssh_host_aliases
from sparkctl.spec.recipes import load_recipe, recipes_dir
from sparkctl.spec.settings import KNOBS


def _complete(line: str, cwd: Path, **env: str) -> list[str]:
    """What `sparkctl` offers for the last word of `line` (a trailing space: a new, empty word)."""
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    base = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("SPARKCTL_")}
    out = subprocess.run([sys.executable, "-m", "sparkctl"], capture_output=True, text=True, cwd=cwd, timeout=60,
                         env={**base, **env, "_SPARKCTL_COMPLETE": "bash_complete", "COMP_WORDS": line,
                              "COMP_CWORD": str(len(words) - 1)})
    assert out.returncode == 0 and out.stderr == "", (line, out.returncode, out.stderr)
    offered = []
    for row in filter(None, out.stdout.splitlines()):  # nothing to offer: one empty line
        kind, _, value = row.partition(",")
        assert kind == "plain", row
        offered.append(value)
    return offered


def _ssh_home(tmp_path: Path) -> Path:
    """A HOME whose ~/.ssh/config names spark1..spark3, patterns, and includes conf.d/* (relative: ~/.ssh)."""
    home = tmp_path / "home"
    (home / ".ssh" / "conf.d").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        "# the cluster\n"
        "Host spark1 spark2\n  HostName 10.0.0.1\n"
        "Host=spark3\n"
        "Host *.lan !sparkbad spark? *\n"
        "Include conf.d/*.conf\n"
    )
    (home / ".ssh" / "conf.d" / "jump.conf").write_text("Host sparkjump\n  User me\n")
    return home


def test_host_aliases_are_the_host_names_of_the_config_and_its_includes(tmp_path, monkeypatch):
    home = _ssh_home(tmp_path)
    other = tmp_path / "other.conf"
    other.write_text(f'host  "gpu 1" gpu2\nMatch host x\nINCLUDE {tmp_path}/extra/*\n')
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "a").write_text("Host gpu3\nInclude " + str(tmp_path / "extra" / "a") + "\n")  # a loop
    assert ssh_host_aliases(str(other)) == ["gpu 1", "gpu2", "gpu3"]
    assert ssh_host_aliases(str(tmp_path / "missing")) == []
    monkeypatch.setenv("HOME", str(home))  # ~/.ssh/config, then /etc/ssh/ssh_config (this machine's)
    assert ssh_host_aliases(None)[:4] == ssh_host_aliases("~/.ssh/config")[:4] == [
        "spark1", "spark2", "spark3", "sparkjump"]


def test_node_names_complete_from_the_ssh_config_in_effect(tmp_path):
    home = _ssh_home(tmp_path)
    # ~/.ssh/config (its Include under ~/.ssh), for trust's NODE arguments and the global --nodes
    assert _complete("sparkctl trust sp", tmp_path, HOME=str(home)) == ["spark1", "spark2", "spark3", "sparkjump"]
    assert _complete("sparkctl trust spark1 spark", tmp_path, HOME=str(home))[:2] == ["spark1", "spark2"]
    assert _complete("sparkctl --nodes spark", tmp_path, HOME=str(home)) == ["spark1", "spark2", "spark3", "sparkjump"]
    # SPARKCTL_SSH_CONFIG, and --ssh-config after the command (the hidden copy of the global option)
    cfg = tmp_path / "cluster.ssh"
    cfg.write_text("Host node-a node-b\n")
    assert _complete("sparkctl --nodes ", tmp_path, HOME=str(home), SPARKCTL_SSH_CONFIG=str(cfg)) == [
        "node-a", "node-b"]
    assert _complete(f"sparkctl trust --ssh-config {cfg} n", tmp_path, HOME=str(home)) == ["node-a", "node-b"]
    # a config that is not there completes nothing, silently
    assert _complete("sparkctl --ssh-config /nonexistent/config trust ", tmp_path, HOME=str(home)) == []


def _renamed_lab_recipe(dest: Path) -> Path:
    text = (recipes_dir() / "lab.toml").read_text()
    text = text.replace('name = "lab"', 'name = "lab-renamed"', 1).replace('name = "dcp"', 'name = "first"')
    path = dest / "renamed.toml"
    path.write_text(text.replace('name = "keys3"', 'name = "last"'))
    return path


def test_build_only_completes_the_layers_of_the_recipe_in_effect(tmp_path):
    default = load_recipe("glm53-exl3-tp4").layer_names()
    assert default == ["dcp", "mul1", "v145", "keys", "keys3"]
    assert _complete("sparkctl build --only ", tmp_path) == default  # the default recipe (no NODES, no MODEL)
    assert _complete("sparkctl build --only k", tmp_path) == ["keys", "keys3"]
    recipe = _renamed_lab_recipe(tmp_path)
    renamed = ["first", "mul1", "v145", "keys", "last"]
    assert _complete(f"sparkctl --recipe {recipe} build --only ", tmp_path) == renamed
    assert _complete(f"sparkctl build --recipe {recipe} --only ", tmp_path) == renamed
    assert _complete("sparkctl build --only ", tmp_path, RECIPE=str(recipe)) == renamed
    (tmp_path / "cluster.env").write_text(f"RECIPE={recipe}\n")
    assert _complete("sparkctl --env-file cluster.env build --only ", tmp_path) == renamed
    # a prebuilt recipe builds no layers; a recipe that is not there completes nothing
    assert _complete("sparkctl --recipe glm53-exl3-2.75bpw build --only ", tmp_path) == []
    assert _complete("sparkctl --recipe nosuch build --only ", tmp_path) == []


def test_rank_completes_the_ranks_of_the_settings_in_effect(tmp_path):
    # the default recipe's TP=4: 4 nodes are one replica of 4 ranks, 8 nodes two of 4
    assert _complete("sparkctl --nodes 'a b c d' logs --rank ", tmp_path) == ["0", "1", "2", "3"]
    assert _complete("sparkctl logs --replica 1 --nodes 'a b c d e f g h' --rank ", tmp_path) == [
        "0", "1", "2", "3"]
    assert _complete("sparkctl exec --rank ", tmp_path, NODES="a b c d", TP="2") == ["0", "1"]
    (tmp_path / "cluster.env").write_text("NODES=a b c d\nTP=1\n")
    assert _complete("sparkctl --env-file cluster.env exec --rank ", tmp_path) == ["0"]
    assert _complete("sparkctl exec --rank 1", tmp_path, NODES="a b c d e f g h i j k l", TP="12") == [
        "1", "10", "11"]
    # settings without a topology complete nothing, silently: no NODES, NODES that split into no TP group,
    # a TP that is not a number, a replica that is not there
    assert _complete("sparkctl logs --rank ", tmp_path) == []
    assert _complete("sparkctl exec --rank ", tmp_path, NODES="a b c") == []
    assert _complete("sparkctl exec --rank ", tmp_path, NODES="a b c d", TP="four") == []
    assert _complete("sparkctl logs --replica 3 --rank ", tmp_path, NODES="a b c d") == []
