"""What `builders` promises about the command lines and environments it returns (what
`bench/mutation.py builders` showed untested, each claim asserted on the argv or env a node receives).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import UsageError
from sparkctl.spec.builders import (
    LABEL_CONTENT_HASH,
    LABEL_LAYER,
    LABEL_RECIPE,
    LABEL_VERSION,
    api_bind_host,
    container_options,
    docker_build_argv,
    docker_run_argv,
    env_file_text,
    image_labels,
    master_addr,
    open_api_warning,
    rank_env,
    rank_specs,
    speculative_config,
    vllm_serve_argv,
)
from sparkctl.spec.planner import make_plan, read_checkpoint
from sparkctl.spec.settings import RankPins, Settings, load_settings

NODES = "spark1 spark2 spark3 spark4"


def pins_for(n: int) -> dict[str, str]:
    return {f"RANK{r}_{k}": v for r in range(n) for k, v in
            (("FABRIC_IP", f"10.0.0.{r + 1}"), ("CX7_IF", "enp1s0f0np0"), ("CX7_IB", "rocep1s0f0"), ("GID_INDEX", "3"))}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    from tests.conftest import write_model

    return write_model(tmp_path / "m", 1_000_000_000, 2)


def _load(model: Path, extra: dict[str, str] | None = None, *, nodes: str = NODES, pins: bool = True) -> Settings:
    environ = {"NODES": nodes, "MODEL": str(model), **(pins_for(len(nodes.split())) if pins else {}), **(extra or {})}
    return load_settings(cli={}, environ=environ)


def _pins(s: Settings) -> list[RankPins]:
    return [s.rank_pins(r) for r in range(len(s.nodes))]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_dspark_drafter_config_names_the_drafter_folder_and_the_token_count_exactly(clean_env: Any,
                                                                                           model: Path,
                                                                                           tmp_path: Path) -> None:
    """The recipe's template, filled with DSPARK (JSON-escaped: a backslash in the path stays one) and SPEC_K;
    the method read from an env file, as an operator sets it."""
    drafter = "/models/dspark\\v2 drafter"
    env = tmp_path / "cluster.env"
    env.write_text("RECIPE=glm53-exl3-2.75bpw\nSPEC_METHOD=dspark\nSPEC_K=5\n")
    s = load_settings(env_file=str(env), cli={},
                      environ={"NODES": NODES, "MODEL": str(model), **pins_for(4), "DSPARK": drafter})
    spec = speculative_config(s)
    assert spec is not None
    assert json.loads(spec) == {"method": "dspark", "model": drafter, "num_speculative_tokens": 5}
    plan = make_plan(_load(model), read_checkpoint(model))  # the drafter's own cache is planner.py's business
    argv = vllm_serve_argv(s, plan, 0, _pins(s))
    assert json.loads(_flag(argv, "--speculative-config"))["model"] == drafter


def test_the_last_host_decides_where_the_api_listens(clean_env: Any, model: Path) -> None:
    """Only `--host VALUE` and `--host=VALUE` set the address; a flag after it that takes a value does not."""
    s = _load(model, {"VLLM_EXTRA_ARGS": "--host 127.0.0.1 --dtype auto --tokenizer-mode auto"})
    assert api_bind_host(s) == "127.0.0.1"
    assert open_api_warning(s) is None


# --host last at an even and an odd index, and past the 256th word (where ints stop being shared objects)
@pytest.mark.parametrize("extra", ["--host", "--enforce-eager --host", "--enforce-eager " * 300 + "--host"])
def test_a_trailing_host_without_a_value_leaves_every_interface_and_the_warning(clean_env: Any, model: Path,
                                                                                  extra: str) -> None:
    s = _load(model, {"VLLM_EXTRA_ARGS": extra})
    assert api_bind_host(s) == "0.0.0.0"
    assert "listen on 0.0.0.0 without an API key" in (open_api_warning(s) or "")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_every_loopback_address_is_private_without_a_key(clean_env: Any, model: Path, host: str) -> None:
    assert open_api_warning(_load(model, {"VLLM_EXTRA_ARGS": f"--host {host}"})) is None
    assert open_api_warning(_load(model, {"VLLM_EXTRA_ARGS": f"--host={host}"})) is None


def test_docker_build_argv_is_tag_base_sorted_labels_then_the_context_last() -> None:
    labels = image_labels("r", "serve", "c0ffee")
    assert labels == {LABEL_RECIPE: "r", LABEL_LAYER: "serve", LABEL_CONTENT_HASH: "c0ffee",
                      LABEL_VERSION: labels[LABEL_VERSION]}
    argv = docker_build_argv("t:1", "sha256:abc", {"b": "2", "a": "1"}, "ctx", no_cache=True, base_arg="PARENT")
    assert argv == ["docker", "build", "--tag", "t:1", "--build-arg", "PARENT=sha256:abc",
                    "--label", "a=1", "--label", "b=2", "--no-cache", "ctx"]
    assert docker_build_argv("t", "b", {}, ".") == ["docker", "build", "--tag", "t", "--build-arg", "BASE=b", "."]


def test_only_a_replica_of_several_carries_the_replica_label(clean_env: Any, model: Path) -> None:
    """Two replicas (TP 2 on 4 nodes): each container names its replica; one replica: no replica label at all."""
    two = _load(model, {"TP": "2", "DCP": "2"})
    plan = make_plan(two.replica(1), read_checkpoint(model))
    for index, view in enumerate(two.replicas()):
        specs = rank_specs(view, plan, _pins(view))
        assert [_flag(docker_run_argv(view, spec, "h"), "--name") for spec in specs] == \
            [f"sparkctl-rank{r}" for r in range(2)]
        for spec in specs:
            labels = [w for w in docker_run_argv(view, spec, "h") if w.startswith("sparkctl.replica=")]
            assert labels == [f"sparkctl.replica={index}"]
    one = _load(model)
    spec = rank_specs(one, make_plan(one, read_checkpoint(model)), _pins(one))[0]
    assert not [w for w in docker_run_argv(one, spec, "h") if w.startswith("sparkctl.replica")]


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\x00b", "\n"])
def test_an_env_file_line_never_carries_a_newline_cr_or_nul(bad: str) -> None:
    """One KEY=value per line, sorted: a value that would start another line (or cut one) is refused by key."""
    assert env_file_text({"B": "2", "A": "x=1 y"}) == "A=x=1 y\nB=2\n"
    with pytest.raises(UsageError) as exc:
        env_file_text({"A": "1", "HF_TOKEN": bad})
    assert exc.value.message.startswith("HF_TOKEN: ") and bad not in exc.value.message


def test_the_drafter_and_the_abliteration_folder_are_mounted_read_only(clean_env: Any, model: Path,
                                                                        tmp_path: Path) -> None:
    s = _load(model, {"RECIPE": "glm53-exl3-2.75bpw", "SPEC_METHOD": "dspark", "DSPARK": "/models/drafter",
                      "ABLIT_HOST_DIR": "/srv/ablit"})
    mounts = [w for w in container_options(s) if w.startswith("type=bind")]
    assert mounts == [f"type=bind,source={p},target={p},readonly" for p in (str(model), "/models/drafter", "/srv/ablit")]


def test_a_recipe_that_does_not_set_ablit_leaves_abliteration_off(clean_env: Any, model: Path,
                                                                  tmp_path: Path) -> None:
    """ABLIT=0 in every rank's environment when neither the recipe nor the operator sets it."""
    import sparkctl

    shipped = Path(sparkctl.__file__).parent / "recipes" / "lab.toml"
    mine = tmp_path / "mine.toml"
    mine.write_text("".join(ln for ln in shipped.read_text().splitlines(keepends=True) if not ln.startswith("ABLIT")))
    s = _load(model, {"RECIPE": str(mine)})
    assert s.get("ABLIT") is None
    assert rank_env(s, 0, s.rank_pins(0))["ABLIT"] == "0"


def test_an_unknown_head_fabric_ip_names_the_heads_own_pin_knob(clean_env: Any, model: Path) -> None:
    """The head of replica 1 (TP 2 on 4 nodes) is the third node: its pin is RANK2_FABRIC_IP."""
    for s, key in ((_load(model, pins=False), "RANK0_FABRIC_IP"),
                   (_load(model, {"TP": "2", "DCP": "2"}, pins=False).replica(1), "RANK2_FABRIC_IP")):
        with pytest.raises(UsageError) as exc:
            master_addr(s, _pins(s))
        assert exc.value.message == f"the head's fabric IP is not known ({key} / MASTER_ADDR)"
        assert key in (exc.value.fix or "")
    s = _load(model, {"MASTER_ADDR": "10.9.9.9"}, pins=False)
    assert master_addr(s, _pins(s)) == "10.9.9.9"


@pytest.mark.parametrize(("present", "used"), [
    (["sparkctl-rank1"], "sparkctl-rank1"),
    (["sparkctl-sparkctl-rank1"], "sparkctl-sparkctl-rank1"),
    (["sparkctl-rank1", "sparkctl-sparkctl-rank1"], "sparkctl-rank1"),
    ([], "sparkctl-rank1"),  # neither: docker's own error names today's name
])
def test_a_ranks_docker_command_reaches_its_container_under_either_name(tmp_path, present, used):
    """The default cluster's rank containers are `sparkctl-rankN`; a service an earlier sparkctl started runs
    as `sparkctl-sparkctl-rankN`: docker commands about one rank (logs, exec) reach whichever is there, under
    the real sh. Only the first marker word is the name; the rest of the argv is untouched."""
    import subprocess

    from sparkctl.spec.builders import CONTAINER, rank_docker_argv

    fake = tmp_path / "docker"
    fake.write_text('#!/bin/sh\nif [ "$1" = container ]; then for n in $PRESENT; do [ "$n" = "$3" ] && exit 0; done;'
                    ' exit 1; fi\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    argv = rank_docker_argv("sparkctl", 1, ["docker", "exec", CONTAINER, "echo", CONTAINER, "a b"])
    r = subprocess.run(argv, env={"PATH": f"{tmp_path}:/usr/bin:/bin", "PRESENT": " ".join(present)},
                       capture_output=True, text=True, timeout=30, check=True)
    assert r.stdout.splitlines() == ["exec", used, "echo", CONTAINER, "a b"]


def test_another_clusters_names_are_unchanged_and_need_no_lookup():
    from sparkctl.spec.builders import CONTAINER, container_name, legacy_container_name, rank_docker_argv

    assert container_name("prod", 2) == "sparkctl-prod-rank2" and legacy_container_name("prod", 2) is None
    assert container_name("sparkctl", 2) == "sparkctl-rank2"
    assert rank_docker_argv("prod", 2, ["docker", "logs", CONTAINER]) == ["docker", "logs", "sparkctl-prod-rank2"]
