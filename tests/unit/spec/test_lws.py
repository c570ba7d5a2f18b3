"""`render --target lws`: the manifests parse, Kubernetes' own OpenAPI schemas accept the Service
and the pod templates, the LeaderWorkerSet matches tests/schemas/leaderworkerset-v1.json, each rank's
container runs what `render` gives that rank's `docker run`, and no secret value is ever written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sparkctl.errors import UsageError
from sparkctl.spec import lws
from sparkctl.spec.builders import kv_cache_bytes, master_addr
from sparkctl.spec.planner import make_plan, read_checkpoint
from sparkctl.spec.renderer import Rendered, render_all, resolve_pins
from sparkctl.spec.settings import Settings, load_settings
from tests.conftest import run_cli, write_model

K8S_VERSION = "1.33.0"  # bundled by kubernetes-validate >= 1.33 (its strict, offline schemas)
LWS_SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "leaderworkerset-v1.json"
MODEL = "/models/GLM-5.3-EXL3"
NODES = "spark1 spark2 spark3 spark4"
UNIFORM = {f"RANK{r}_{k}": v for r in range(4) for k, v in (
    ("FABRIC_IP", f"192.168.100.{r + 1}"), ("CX7_IF", "enp1s0f0np0"), ("CX7_IB", "rocep1s0f0"), ("GID_INDEX", "3"))}
SECRETS = {"HF_TOKEN": "hf_lws_secret_never_written", "VLLM_API_KEY": "sk-lws-secret-never-written"}


def _render(tmp_path: Path, **extra: str) -> tuple[Settings, Rendered, list[dict[str, Any]], str]:
    model_dir = tmp_path / "m"
    if not model_dir.exists():
        write_model(model_dir, 308_000_000_000, 41)
    s = load_settings(cli={}, environ={"NODES": NODES, "MODEL": MODEL, **UNIFORM, **SECRETS, **extra})
    rendered = render_all(s, make_plan(s, read_checkpoint(model_dir)), resolve_pins(s))
    docs = lws.render_lws(s, rendered.specs, rendered.config_hash)
    return s, rendered, docs, lws.manifests_yaml(s, docs, rendered.config_hash)


@pytest.fixture
def rendered(clean_env: dict[str, str], tmp_path: Path) -> tuple[Settings, Rendered, list[dict[str, Any]], str]:
    return _render(tmp_path)


def _templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    lwt = doc["spec"]["leaderWorkerTemplate"]
    return {k: lwt[k] for k in ("leaderTemplate", "workerTemplate") if k in lwt}


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of container args and env values, written here from its documented rule:
    `$(NAME)` becomes NAME's value when NAME is defined, `$$` becomes `$`, anything else stays."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def _vllm_part(docker_argv: list[str], image: str) -> list[str]:
    """`docker run ... --entrypoint E IMAGE args...` -> [E, *args]."""
    at = docker_argv.index(image)
    assert docker_argv[at - 2] == "--entrypoint"
    return [docker_argv[at - 1], *docker_argv[at + 1:]]


# ---- (a) YAML ----------------------------------------------------------------------------------------

def test_the_manifests_are_yaml_a_leaderworkerset_then_its_service(rendered: Any) -> None:
    s, _, docs, text = rendered
    loaded = list(yaml.safe_load_all(text))
    assert loaded == docs  # what is written is what was built: nothing lost or aliased on the way
    assert [(d["apiVersion"], d["kind"]) for d in loaded] == [(lws.LWS_API_VERSION, "LeaderWorkerSet"),
                                                             ("v1", "Service")]
    assert "&id" not in text and "*id" not in text
    group = loaded[0]["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 4 and loaded[0]["spec"]["replicas"] == 1
    assert loaded[0]["spec"]["startupPolicy"] == "LeaderCreated"  # LeaderReady would wait for ever


# ---- (b) Kubernetes' own schemas ---------------------------------------------------------------------

def test_the_service_and_every_pod_template_pass_kubernetes_openapi_schemas(rendered: Any) -> None:
    _, _, docs, _ = rendered
    lws_doc, service = docs
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    templates = _templates(lws_doc)
    assert set(templates) == {"leaderTemplate", "workerTemplate"}
    for name, template in templates.items():  # a PodTemplate holds exactly a PodTemplateSpec
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {**lws_doc["metadata"], "name": name.lower()},
                                      "template": template}, K8S_VERSION, strict=True)


def test_the_kubernetes_validator_rejects_a_misspelt_pod_field(rendered: Any) -> None:
    """The check above can fail: strict mode refuses an unknown field of a container."""
    _, _, docs, _ = rendered
    template = json.loads(json.dumps(docs[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]))
    template["spec"]["containers"][0]["volumeMount"] = template["spec"]["containers"][0].pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"},
                                      "template": template}, K8S_VERSION, strict=True)


# ---- (c) the LWS fields -------------------------------------------------------------------------------

def _lws_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(LWS_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_leaderworkerset_matches_the_lws_v1_api(rendered: Any) -> None:
    _, _, docs, _ = rendered
    errors = [e.message for e in _lws_validator().iter_errors(docs[0])]
    assert errors == []


@pytest.mark.parametrize("path, wrong", [
    (("spec",), "startupPolicies"),
    (("spec", "leaderWorkerTemplate"), "sizes"),
    (("spec", "leaderWorkerTemplate"), "workerTemplates"),
])
def test_the_lws_schema_rejects_a_misspelt_field(rendered: Any, path: tuple[str, ...], wrong: str) -> None:
    _, _, docs, _ = rendered
    doc = json.loads(json.dumps(docs[0]))
    where = doc
    for key in path:
        where = where[key]
    right = {"startupPolicies": "startupPolicy", "sizes": "size", "workerTemplates": "workerTemplate"}[wrong]
    where[wrong] = where.pop(right)
    assert list(_lws_validator().iter_errors(doc))


# ---- (d) the same argv, env and bytes as `render` ------------------------------------------------------

def test_each_ranks_container_runs_what_render_gives_its_docker_run(rendered: Any) -> None:
    s, r, docs, _ = rendered
    templates = _templates(docs[0])
    head_addr = master_addr(s, resolve_pins(s))
    for spec, docker_argv in zip(r.specs, r.docker_argv, strict=True):
        pod = templates["leaderTemplate" if spec.rank == 0 else "workerTemplate"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == s.image
        # LWS's values, as its controller sets them for this rank: the leader's address and the worker index.
        env = {"LWS_LEADER_ADDRESS": head_addr, "LWS_WORKER_INDEX": str(spec.rank)}
        argv = [_k8s_expand(w, env) for w in c["command"] + c["args"]]
        assert argv == _vllm_part(docker_argv, s.image)
        assert c["args"][c["args"].index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"


def test_the_kv_bytes_are_the_planners(rendered: Any, tmp_path: Path) -> None:
    s, _, docs, _ = rendered
    plan = make_plan(s, read_checkpoint(tmp_path / "m"))
    for template in _templates(docs[0]).values():
        args = template["spec"]["containers"][0]["args"]
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(kv_cache_bytes(s, plan))


def test_a_literal_dollar_paren_reaches_vllm_unexpanded(clean_env: dict[str, str], tmp_path: Path) -> None:
    s, r, docs, _ = _render(tmp_path, SERVED_MODEL_NAME="glm$(HOSTNAME)")
    (c,) = docs[0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    argv = [_k8s_expand(w, {"HOSTNAME": "pod-0", "LWS_LEADER_ADDRESS": "x"}) for w in c["args"]]
    assert argv[argv.index("--served-model-name") + 1] == "glm$(HOSTNAME)"


def test_the_env_is_rank_env_with_secrets_by_reference_and_the_pods_own_ip(rendered: Any) -> None:
    s, r, docs, _ = rendered
    secret = lws.secret_name(s)
    for name, template in _templates(docs[0]).items():
        spec = r.specs[0 if name == "leaderTemplate" else 1]
        env = template["spec"]["containers"][0]["env"]
        assert [e["name"] for e in env] == sorted(spec.env)
        for e in env:
            if e["name"] in SECRETS:
                assert e == {"name": e["name"], "valueFrom": {"secretKeyRef": {"name": secret, "key": e["name"]}}}
            elif e["name"] == "VLLM_HOST_IP":
                assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            else:
                assert e == {"name": e["name"], "value": spec.env[e["name"]]}
    assert lws.secret_keys(s) == sorted(SECRETS)


# ---- (e) secrets ---------------------------------------------------------------------------------------

def test_no_secret_value_is_written_or_printed(clean_env: dict[str, str], tmp_path: Path, capsys: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_model(tmp_path / "model", 1_000_000, 2)
    for k, v in {"NODES": NODES, "MODEL": str(model), "RECIPE": "lab", **UNIFORM, **SECRETS}.items():
        monkeypatch.setenv(k, v)
    code, out, err = run_cli(["render", "--target", "lws", "--local"], capsys)
    assert code == 0, err
    text = Path("env/lws.yaml").read_text()
    code_j, out_j, err_j = run_cli(["--json", "render", "--target", "lws", "--local", "--out", "j.yaml"], capsys)
    assert code_j == 0, err_j
    for value in SECRETS.values():
        assert value not in text + out + err + out_j + err_j + Path("j.yaml").read_text()
    assert "secretKeyRef" in text and "kubectl create secret generic sparkctl-secrets" in text
    doc = json.loads(out_j)
    assert doc["secret"] == {"name": "sparkctl-secrets", "keys": sorted(SECRETS)}
    assert [o["kind"] for o in doc["objects"]] == ["LeaderWorkerSet", "Service"]
    assert not Path("env/env.tp4").exists()  # the lws target writes only its manifests


# ---- what LWS cannot express ---------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("RANK2_CX7_IF", "enP2p1s0f1np1"), ("RANK3_CX7_IB", "roceP2p1s0f1"),
                                        ("RANK1_GID_INDEX", "4")])
def test_ranks_with_different_nic_pins_are_refused_with_the_fix(clean_env: dict[str, str], tmp_path: Path,
                                                                 key: str, value: str) -> None:
    with pytest.raises(UsageError) as exc:
        _render(tmp_path, **{key: value})
    assert key in exc.value.message and exc.value.fix and "sparkctl up" in exc.value.fix


def test_different_pins_exit_2_on_the_command_line(clean_env: dict[str, str], tmp_path: Path, capsys: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_model(tmp_path / "model", 1_000_000, 2)
    for k, v in {"NODES": NODES, "MODEL": str(model), "RECIPE": "lab", **UNIFORM,
                 "RANK2_CX7_IF": "enP2p1s0f1np1"}.items():
        monkeypatch.setenv(k, v)
    code, _, err = run_cli(["render", "--target", "lws", "--local"], capsys)
    assert code == 2 and "RANK2_CX7_IF" in err and not Path("env/lws.yaml").exists()


def test_a_cluster_name_kubernetes_cannot_take_is_refused(clean_env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="CLUSTER_NAME"):
        _render(tmp_path, CLUSTER_NAME="my_cluster")


# ---- volumes, resources, probes, the Service -------------------------------------------------------------

@pytest.mark.parametrize("knob, source", [
    ("hostpath", {"hostPath": {"path": MODEL, "type": "Directory"}}),
    ("pvc:glm-weights", {"persistentVolumeClaim": {"claimName": "glm-weights", "readOnly": True}}),
])
def test_the_model_is_mounted_read_only_at_its_path(clean_env: dict[str, str], tmp_path: Path, knob: str,
                                                    source: dict[str, Any]) -> None:
    _, _, docs, _ = _render(tmp_path, LWS_MODEL_VOLUME=knob)
    for template in _templates(docs[0]).values():
        pod = template["spec"]
        assert pod["volumes"][0] == {"name": "model", **source}
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "model", "mountPath": MODEL, "readOnly": True} in mounts
        assert all(m.get("readOnly") for m in mounts if m["name"] != "dshm")


def test_a_bad_model_volume_is_refused(clean_env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="LWS_MODEL_VOLUME"):
        _render(tmp_path, LWS_MODEL_VOLUME="nfs:/x")


def test_shm_gpus_network_and_the_ulimits_note(rendered: Any) -> None:
    s, _, docs, _ = rendered
    for template in _templates(docs[0]).values():
        pod = template["spec"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
        res = pod["containers"][0]["resources"]
        assert res == {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        notes = template["metadata"]["annotations"]
        assert "nofile=1048576:1048576" in notes["sparkctl/ulimits"] and "/dev/infiniband" in notes["sparkctl/devices"]


def test_probes_on_the_leader_only_and_the_service_selects_leaders(rendered: Any) -> None:
    s, _, docs, _ = rendered
    lws_doc, service = docs
    leader = lws_doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = lws_doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert leader["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8888, "scheme": "HTTP"}
    assert leader["startupProbe"]["periodSeconds"] * leader["startupProbe"]["failureThreshold"] >= 3600
    command = leader["readinessProbe"]["exec"]["command"]
    assert command[:3] == ["python3", "-c", lws.READINESS_SCRIPT] and command[3] == "GLM-5.3-EXL3"
    assert not any(k.endswith("Probe") for k in worker) and "ports" not in worker
    assert service["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": "sparkctl",
                                           "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert service["spec"]["ports"] == [{"name": "http", "protocol": "TCP", "port": 8888, "targetPort": 8888}]


def test_replicas_is_a_parameter(rendered: Any) -> None:
    s, r, _, _ = rendered
    docs = lws.render_lws(s, r.specs, r.config_hash, replicas=3)
    assert docs[0]["spec"]["replicas"] == 3 and docs[0]["spec"]["leaderWorkerTemplate"]["size"] == 4
    with pytest.raises(UsageError):
        lws.render_lws(s, r.specs, r.config_hash, replicas=0)


# ---- the readiness probe does what `wait` does ----------------------------------------------------------

class _Api(BaseHTTPRequestHandler):
    models: list[str] = []
    choices: list[Any] = []
    auth: list[str | None] = []

    def _answer(self, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).auth.append(self.headers.get("Authorization"))
        self._answer({"data": [{"id": m} for m in type(self).models]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer({"choices": type(self).choices})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("models, choices, ok", [
    (["GLM-5.3-EXL3"], [{"message": {"content": "pong"}}], True),
    (["other"], [{"message": {"content": "pong"}}], False),  # up, but not serving this model
    (["GLM-5.3-EXL3"], [], False),  # listed, but no completion comes back
])
def test_the_readiness_probe_needs_the_model_listed_and_a_completion(api: str, models: list[str],
                                                                     choices: list[Any], ok: bool) -> None:
    _Api.models, _Api.choices, _Api.auth = models, choices, []
    done = subprocess.run([sys.executable, "-c", lws.READINESS_SCRIPT, "GLM-5.3-EXL3", api], capture_output=True,
                          timeout=60, env={"VLLM_API_KEY": "k1"})
    assert (done.returncode == 0) is ok, done.stderr
    assert _Api.auth == ["Bearer k1"]


def _eight(differ: dict[str, str] | None = None) -> dict[str, str]:
    pins = {f"RANK{r}_{k}": v for r in range(8) for k, v in (
        ("FABRIC_IP", f"192.168.100.{r + 1}"), ("CX7_IF", "enp1s0f0np0"), ("CX7_IB", "rocep1s0f0"),
        ("GID_INDEX", "3"))}
    return {"NODES": " ".join(f"spark{i}" for i in range(1, 9)), "RECIPE": "lab", **pins, **(differ or {})}


def test_replicas_of_the_topology_are_the_leaderworkersets_groups(clean_env: dict[str, str], tmp_path: Path,
                                                                  capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 nodes at TP4: one LeaderWorkerSet of 2 groups of 4 pods; a rank of the second replica whose NIC
    differs is refused by its knob's name in the env file (RANK5_..., its position in NODES)."""
    model = write_model(tmp_path / "model", 1_000_000, 2)
    for k, v in {"MODEL": str(model), **_eight()}.items():
        monkeypatch.setenv(k, v)
    code, out, err = run_cli(["--json", "render", "--target", "lws", "--local"], capsys)
    assert code == 0, err
    lws_doc = next(yaml.safe_load_all(Path("env/lws.yaml").read_text()))
    assert lws_doc["spec"]["replicas"] == 2 and lws_doc["spec"]["leaderWorkerTemplate"]["size"] == 4
    monkeypatch.setenv("RANK5_CX7_IF", "enP2p1s0f1np1")
    code, _, err = run_cli(["render", "--target", "lws", "--local", "--out", "other.yaml"], capsys)
    assert code == 2 and "RANK5_CX7_IF" in err and not Path("other.yaml").exists(), err
