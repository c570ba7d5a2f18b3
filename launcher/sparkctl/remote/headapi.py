"""The one client for the head's HTTP API (vLLM's OpenAI server): `wait`, `status`, `watch` and `bench` ask
through it -- /health, /v1/models, a chat completion, /metrics, /tokenize. Every answer is read with a size
cap and checked for its shape (the head's answers are untrusted). `bench`'s measured requests are the one
exception: they stream on a raw socket, each chunk dated to its packet (loadgen.request), which an HTTP
library cannot do; they use this module's Endpoint.

The Prometheus text of /metrics is parsed by promtext.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests

from ..errors import CheckFailed, UsageError
from ..facts.parsing import ParseError, parse_json


@dataclass(frozen=True)
class Endpoint:
    """Where the OpenAI API is: scheme, host, port and a base path ('' or '/prefix')."""

    scheme: str
    host: str
    port: int
    base: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        try:
            u = urlsplit(url.strip() if "://" in url else "http://" + url.strip())
            port = u.port
        except ValueError as exc:
            raise UsageError(f"--url {url!r} is not a URL ({exc})", fix="e.g. http://10.0.0.1:8888") from None
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"--url {url!r} must be an http:// or https:// URL with a host",
                             fix="e.g. http://10.0.0.1:8888")
        base = u.path.rstrip("/")
        if base.endswith("/v1"):  # people paste the OpenAI base URL; the paths below add /v1 themselves
            base = base[:-3]
        return cls(u.scheme, u.hostname, port or (443 if u.scheme == "https" else 80), base)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.base}"


MAX_JSON_ANSWER = 4 << 20  # /v1/models and a chat completion are a few KB
MAX_METRICS_ANSWER = 16 << 20  # vLLM's /metrics is well under 1 MB


class BadAnswer(CheckFailed):
    """The head answered, but not what vLLM answers (not JSON, the wrong shape, too large)."""


def _request(method: str, url: str, **kw: Any) -> requests.Response:
    """requests' `request`, but never through a proxy: the environment's http_proxy, HTTPS_PROXY, ALL_PROXY
    (and NO_PROXY) are not read, nor ~/.netrc (whose password would replace the Authorization header), so
    the API key goes to the head and nowhere else. A CA bundle named by REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE
    is still used for an https:// head, as before."""
    with requests.Session() as session:
        session.trust_env = False
        session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
        return session.request(method, url, **kw)


def _read_capped(r: requests.Response, limit: int, what: str) -> bytes:
    """The body, refusing to hold more than `limit` bytes of it (the head's answers are untrusted)."""
    chunks: list[bytes] = []
    size = 0
    for chunk in r.iter_content(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise BadAnswer(f"the head's {what} answer is larger than {limit >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        doc = parse_json(body)
    except ParseError:  # not JSON, not UTF-8, or absurdly nested
        raise BadAnswer(f"the head's {what} answer is not JSON: {body[:80]!r}") from None
    if not isinstance(doc, dict):
        raise BadAnswer(f"the head's {what} answer is JSON but not an object ({type(doc).__name__})")
    return doc


@dataclass
class HeadApi:
    """The head's OpenAI API. Every answer is read with a size cap and checked for its shape."""

    base_url: str
    api_key: str | None = None
    timeout: float = 5.0

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> int | None:
        try:
            with _request("GET", f"{self.base_url}/health", timeout=self.timeout, headers=self._headers(),
                              stream=True) as r:
                return r.status_code
        except requests.RequestException:
            return None

    def models(self) -> list[str]:
        with _request("GET", f"{self.base_url}/v1/models", timeout=self.timeout, headers=self._headers(),
                          stream=True) as r:
            r.raise_for_status()
            doc = _json_object(_read_capped(r, MAX_JSON_ANSWER, "/v1/models"), "/v1/models")
        data = doc.get("data")
        if not isinstance(data, list):
            raise BadAnswer("the head's /v1/models answer has no \"data\" list")
        ids = [m.get("id") for m in data if isinstance(m, dict)]
        return [i[:512] for i in ids if isinstance(i, str)]

    def chat(self, model: str, prompt: str, max_tokens: int = 32, timeout: float = 120.0) -> tuple[str, float]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}}
        start = time.monotonic()
        with _request("POST", f"{self.base_url}/v1/chat/completions", json=body, timeout=timeout,
                           headers=self._headers(), stream=True) as r:
            r.raise_for_status()
            doc = _json_object(_read_capped(r, MAX_JSON_ANSWER, "chat completion"), "chat completion")
        latency = time.monotonic() - start
        choices = doc.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None:
            raise BadAnswer("the head's chat completion has no choices")
        message = choice.get("message")
        content = message.get("content") if isinstance(message, dict) else None
        for text in (content, choice.get("text")):
            if isinstance(text, str):
                return text[:4096], latency
        return "", latency

    def metrics(self) -> str | None:
        try:
            with _request("GET", f"{self.base_url}/metrics", timeout=self.timeout, headers=self._headers(),
                              stream=True) as r:
                if not r.ok:
                    return None
                return _read_capped(r, MAX_METRICS_ANSWER, "/metrics").decode("utf-8", "replace")
        except (requests.RequestException, BadAnswer):
            return None

    @classmethod
    def of(cls, ep: Endpoint, api_key: str | None = None, timeout: float = 10.0) -> HeadApi:
        return cls(ep.url, api_key, timeout)

    def get(self, path: str, *, limit: int = MAX_JSON_ANSWER, timeout: float | None = None) -> tuple[int, bytes]:
        """A plain GET: the status and the body (capped: BadAnswer). Raises requests' errors when the
        head cannot be reached or the answer breaks off."""
        with _request("GET", f"{self.base_url}{path}", timeout=timeout or self.timeout, headers=self._headers(),
                          stream=True) as r:
            return r.status_code, _read_capped(r, limit, path)

    def post_json(self, path: str, payload: dict[str, Any], *, timeout: float | None = None) -> tuple[int, Any]:
        """POST a JSON body: the status and the JSON answer (None when it is not JSON). Raises requests'
        errors when the head cannot be reached, BadAnswer when the answer is too large."""
        with _request("POST", f"{self.base_url}{path}", json=payload, timeout=timeout or self.timeout,
                           headers=self._headers(), stream=True) as r:
            body = _read_capped(r, MAX_JSON_ANSWER, path)
            status = r.status_code
        try:
            return status, parse_json(body)
        except ParseError:
            return status, None


def reason(exc: BaseException) -> str:
    """Why the head could not be reached, in a few words (the cause under requests' and urllib3's wrappers)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return "connection refused (nothing listens on that port: is the service up?)"
        if isinstance(e, socket.gaierror):
            return f"cannot resolve the host name ({e.strerror})"
        if isinstance(e, TimeoutError | socket.timeout | requests.Timeout):
            return "timed out"
        todo += [x for x in (e.__cause__, e.__context__, getattr(e, "reason", None), *e.args)
                 if isinstance(x, BaseException)]
    return (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)[:300]
