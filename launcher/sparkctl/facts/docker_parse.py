"""Docker's output, parsed in one place: the CLI's `--format '{{json .}}'` lines, `docker image
inspect` and `docker inspect` JSON, and the Engine API's answers (JSON bodies and the headers curl
printed). Every caller that reads what a node's Docker said -- the facts probe (`facts`), `up`/`status`
(`service`), `build` and its probe (`orchestrate/build`, `images`), the release history (`history`) --
parses it here.

Node output is untrusted: a parser returns its value or raises ParseError (`parsing.guard`), and
`ContainerState.from_inspect` turns a field of the wrong type or size into a neutral value.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..spec.builders import LABEL_CONFIG_HASH, LABEL_CONTENT_HASH, LABEL_RANK
from .parsing import NotJson, ParseError, guard, parse_json

# ------------------------------------------------------------------- the CLI: version, images, ps


@dataclass(frozen=True)
class DockerVersion:
    client_version: str | None
    server_version: str | None  # None when the engine could not be reached
    api_version: str | None
    os: str | None
    arch: str | None


@guard
def parse_docker_version(text: str) -> DockerVersion:
    """`docker version --format '{{json .}}'` (Server is null when the engine is down)."""
    data = parse_json(text.strip().splitlines()[0] if text.strip() else "")
    if not isinstance(data, dict):
        raise ParseError("docker version did not print a JSON object")
    server = _dict(data.get("Server"))  # {} when the engine could not be reached
    return DockerVersion(
        client_version=_opt_str(_dict(data.get("Client")).get("Version")),
        server_version=_opt_str(server.get("Version")),
        api_version=_opt_str(server.get("ApiVersion")),
        os=_opt_str(server.get("Os")),
        arch=_opt_str(server.get("Arch")),
    )


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


@dataclass(frozen=True)
class Image:
    id: str
    repo_tags: tuple[str, ...]
    labels: dict[str, str]
    layers: tuple[str, ...]
    architecture: str | None = None
    repo_digests: tuple[str, ...] = ()  # `repo@sha256:...` it was pulled as (none after save | load or a build)
    cuda_version: str | None = None  # Config.Env's CUDA_VERSION (NVIDIA's CUDA base images set it); no other env


@guard
def parse_image_inspect(text: str) -> list[Image]:
    """`docker image inspect A B ...`: the images found (missing ones appear only on stderr)."""
    if not text.strip():
        return []
    data = parse_json(text)
    if not isinstance(data, list):
        raise ParseError("docker image inspect did not print a list")
    out = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("Id"), str):
            raise ParseError("docker image inspect entry without Id")
        out.append(
            Image(
                id=item["Id"],
                repo_tags=tuple(t for t in _list(item.get("RepoTags")) if isinstance(t, str)),
                labels={str(k): str(v) for k, v in _dict(_dict(item.get("Config")).get("Labels")).items()},
                layers=tuple(str(x) for x in _list(_dict(item.get("RootFS")).get("Layers"))),
                architecture=_opt_str(item.get("Architecture")),
                repo_digests=tuple(d for d in _list(item.get("RepoDigests")) if isinstance(d, str)),
                cuda_version=_env_cuda(_list(_dict(item.get("Config")).get("Env"))),
            )
        )
    return out


def _env_cuda(env: list[Any]) -> str | None:
    """CUDA_VERSION=13.0.1 from an image's Config.Env -> '13.0.1' (the only variable read: the rest may
    hold secrets)."""
    for item in env:
        if isinstance(item, str) and item.startswith("CUDA_VERSION="):
            value = item.partition("=")[2].strip()
            return value[:32] if re.fullmatch(r"\d{1,3}(\.\d{1,4}){0,3}", value) else None
    return None


def normalize_image_ref(ref: str) -> str:
    """How docker names a reference in RepoTags: 'x' -> 'x:latest', 'docker.io/library/x:1' -> 'x:1'."""
    name, tag = ref, "latest"
    if "@" in ref:
        return ref
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = ref.rsplit(":", 1)
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return f"{name}:{tag}"


def find_image(images: Iterable[Image], ref: str) -> Image | None:
    """The inspected image that `ref` names (by tag, by `repo@sha256:` digest, or by full/short ID)."""
    want = normalize_image_ref(ref)
    for img in images:
        if want in img.repo_tags or ref in img.repo_digests or ref in (img.id, img.id.removeprefix("sha256:")):
            return img
        if len(ref) >= 12 and img.id.removeprefix("sha256:").startswith(ref.removeprefix("sha256:")):
            return img
    return None


@dataclass(frozen=True)
class Container:
    id: str
    names: str
    image: str
    state: str  # created, running, exited, ...
    status: str
    labels: dict[str, str]


@guard
def parse_docker_ps(text: str) -> list[Container]:
    """`docker ps -a --format '{{json .}}'`: one JSON object per line; Labels is 'k=v,k2=v2'."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        item = parse_json(line)
        if not isinstance(item, dict) or not isinstance(item.get("ID"), str):
            raise ParseError("docker ps line without ID")
        labels = {}
        for pair in str(item.get("Labels") or "").split(","):
            if pair:
                k, _, v = pair.partition("=")
                labels[k] = v
        out.append(
            Container(
                id=item["ID"],
                names=str(item.get("Names", "")),
                image=str(item.get("Image", "")),
                state=str(item.get("State", "")),
                status=str(item.get("Status", "")),
                labels=labels,
            )
        )
    return out


# ------------------------------------------------------------- docker API (the probe's docker-api)

DOCKER_SECTIONS: Final = ("docker-version", "docker-ps", "docker-images")
"""The problem keys of the three Docker facts, whether they came from the CLI or from the API."""


def docker_api_paths(cluster: str, image: str | None, *more: str) -> list[str]:
    """Engine API paths the probe asks (with curl over the engine's unix socket): this cluster's
    containers, then each image (IMAGE, and BASE_IMAGE when asked). (The engine's version comes with
    every answer's headers.) Percent-encoded here, so nothing in them is URL syntax."""
    filters = urllib.parse.quote(json.dumps({"label": [f"sparkctl.cluster={cluster}"]}), safe="")
    paths = [f"/containers/json?all=1&filters={filters}"]
    for ref in (image, *more):
        if ref:
            paths.append(f"/images/{urllib.parse.quote(ref, safe='/:@')}/json")
    return paths


def _http_reply(raw: str) -> tuple[dict[str, str], str]:
    """curl -D - output of one answer: (headers with lower-case names, body)."""
    if not raw.startswith("HTTP/"):
        return {}, raw
    head, sep, body = raw.partition("\r\n\r\n")
    if not sep:
        head, _, body = raw.partition("\n\n")
    headers: dict[str, str] = {}
    for line in head.splitlines()[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()[:200]
    return headers, body


_SERVER = re.compile(r"Docker/([0-9A-Za-z.+~_-]+)(?:\s*\(([^)]*)\))?")


def docker_version_from_headers(headers: Mapping[str, str]) -> DockerVersion:
    """The engine's version from the headers it puts on every answer: "Server: Docker/27.5.1
    (linux)", "Api-Version: 1.47". An engine that answers without them is still an engine."""
    server = headers.get("server", "")
    m = _SERVER.fullmatch(server.strip())
    version = m.group(1) if m else (server or "unknown (no Server header)")
    os_name = (m.group(2) if m else None) or headers.get("ostype") or None
    return DockerVersion(None, version, headers.get("api-version") or None, os_name, None)


@dataclass(frozen=True)
class DockerFacts:
    version: DockerVersion | None
    containers: list[Container] | None
    images: list[Image] | None
    problems: dict[str, str]


def parse_docker_api(stdout: str, stderr: str, rc: int, nonce: str) -> DockerFacts:
    """The probe's docker-api section: 'socket unix://PATH', then per request curl's headers and body
    followed by '@@sparkctl NONCE http CODE' (000: no answer): the containers, then the image.
    Never raises: what went wrong goes to .problems."""
    head, _, rest = stdout.partition("\n")
    where = head.removeprefix("socket ").strip()[:200] or "its socket"
    parts = re.split(rf"\n?@@sparkctl {re.escape(nonce)} http (\d{{3}})\n", rest)
    replies = [(int(code), *_http_reply(raw)) for raw, code in zip(parts[0::2], parts[1::2], strict=False)]
    if not replies or any(code == 0 for code, _, _ in replies):
        err = next((ln.strip() for ln in stderr.splitlines() if ln.strip()), f"exit status {rc}")
        why = f"cannot connect to the Docker engine at {where} ({err[:200]})"
        return DockerFacts(None, None, None, dict.fromkeys(DOCKER_SECTIONS, why))
    problems: dict[str, str] = {}

    def body_json(i: int, key: str) -> Any:
        code, _, body = replies[i] if i < len(replies) else (0, {}, "")
        if code != 200:
            problems[key] = _api_message(code, body)
            return None
        try:
            return parse_json(body)
        except ParseError as exc:
            problems[key] = str(exc)
            return None

    version = docker_version_from_headers(replies[0][1])
    containers: list[Container] | None = None
    c = body_json(0, "docker-ps")
    if c is not None:
        try:
            containers = _containers_from_api(c)
        except ParseError as exc:
            problems["docker-ps"] = str(exc)
    images: list[Image] | None = None
    for n in range(1, len(replies)):  # one answer per image asked; 404: not on the node
        if replies[n][0] == 404:
            images = images if images is not None else []
            continue
        i = body_json(n, "docker-images")
        if i is not None:
            try:
                images = (images or []) + parse_image_inspect(json.dumps([i]))
            except ParseError as exc:
                problems["docker-images"] = str(exc)
    if "docker-images" in problems:
        images = None
    return DockerFacts(version, containers, images, problems)


def _api_message(code: int, body: str) -> str:
    try:
        doc = parse_json(body)
    except ParseError:
        doc = None
    msg = doc.get("message") if isinstance(doc, dict) else None
    return f"HTTP {code}: {str(msg)[:300]}" if msg else f"HTTP {code}"


def _containers_from_api(data: Any) -> list[Container]:
    """GET /containers/json: [{"Id", "Names": ["/name"], "Image", "State", "Status", "Labels": {}}]."""
    if not isinstance(data, list):
        raise ParseError("the container list is not a list")
    out = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("Id"), str):
            raise ParseError("container without Id")
        out.append(
            Container(
                id=item["Id"],
                names=",".join(str(n).lstrip("/") for n in _list(item.get("Names"))),
                image=str(item.get("Image", "")),
                state=str(item.get("State", "")),
                status=str(item.get("Status", "")),
                labels={str(k): str(v) for k, v in _dict(item.get("Labels")).items()},
            )
        )
    return out


# ------------------------------------------------------------ containers (`docker inspect`)


@dataclass(frozen=True)
class ContainerState:
    """One sparkctl container as `docker inspect` sees it."""

    id: str
    name: str
    rank: int | None
    config_hash: str | None
    image_id: str
    status: str  # created | running | exited | dead | ...
    running: bool
    exit_code: int
    started_at: str
    restarts: int
    error: str
    content_hash: str | None = None  # the image's sparkctl.content-hash (containers inherit image labels)

    @property
    def image_identity(self) -> str:
        """Same on every rank for the same image: its content hash when sparkctl built it, else its ID."""
        return self.content_hash or self.image_id

    @classmethod
    def from_inspect(cls, doc: dict[str, Any]) -> ContainerState:
        """From one `docker inspect` object. Node output is untrusted: a field of the wrong type or
        size becomes a neutral value (unknown rank, exit code 0, ...), never an exception."""
        cfg = _dict(doc.get("Config"))
        labels = _dict(cfg.get("Labels"))
        state = _dict(doc.get("State"))
        return cls(
            id=_text(doc.get("Id"), 64),
            name=_text(doc.get("Name"), 256).lstrip("/"),
            rank=_small_int(labels.get(LABEL_RANK)),
            config_hash=_label(labels, LABEL_CONFIG_HASH),
            image_id=_text(doc.get("Image"), 256),
            status=_text(state.get("Status"), 32) or "unknown",
            running=state.get("Running") is True,
            exit_code=_small_int(state.get("ExitCode"), signed=True) or 0,
            started_at=_text(state.get("StartedAt"), 64),
            restarts=_small_int(doc.get("RestartCount")) or 0,
            error=_text(state.get("Error"), 500),
            content_hash=_label(labels, LABEL_CONTENT_HASH),
        )

    def uptime_s(self, now: _dt.datetime | None = None) -> float | None:
        # Docker prints nanoseconds ("2026-11-29T11:30:00.123456789Z"); seconds are enough here.
        m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", self.started_at)
        if not self.running or not m:
            return None
        try:
            started = _dt.datetime.fromisoformat(m.group(1)).replace(tzinfo=_dt.UTC)
        except ValueError:  # digits in the right places but not a date (month 13)
            return None
        return ((now or _dt.datetime.now(_dt.UTC)) - started).total_seconds()


def _text(value: Any, limit: int) -> str:
    if value is None or isinstance(value, dict | list):
        return ""
    return str(value)[:limit]


def _label(labels: dict[str, Any], key: str) -> str | None:
    value = labels.get(key)
    return value[:128] if isinstance(value, str) and value else None


def _small_int(value: Any, *, signed: bool = False) -> int | None:
    """An integer field from node output: an int, or a string of at most 9 digits; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if (signed or value >= 0) and abs(value) < 10**9 else None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
        return int(value)
    return None


def parse_container_inspect(text: str) -> list[ContainerState]:
    """`docker inspect ID...` (service's _INSPECT prints '[]' when there is none): one state per object."""
    try:
        docs = parse_json(text or "[]")
    except NotJson as exc:
        raise ParseError(f"docker inspect printed something that is not JSON ({exc.reason})") from None
    if not isinstance(docs, list):
        raise ParseError("docker inspect did not print a list")
    return [ContainerState.from_inspect(d) for d in docs if isinstance(d, dict)]


# ------------------------------------------------------------------ one value from --format '{{...}}'


def parse_format_value(text: str) -> str | None:
    """What `docker ... --format '{{.Id}}'` printed for one object: the value, or None when empty."""
    return text.strip() or None


def parse_content_hash(text: str) -> str | None:
    """`--format '{{index .Config.Labels "sparkctl.content-hash"}}'`: the label is `sha256:<hex>`;
    the hex (12 to 64 digits), or None for anything else (no label: '' or '<no value>')."""
    value = text.strip().removeprefix("sha256:")
    return value if re.fullmatch(r"[0-9a-f]{12,64}", value) else None
