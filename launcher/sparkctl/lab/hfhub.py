"""A stand-in Hugging Face Hub for the lab: the routes the real `huggingface_hub` client calls, no more.

    hub = StandinHub(root)                                 # repos live under root/
    sha = hub.publish("lab/GLM-5.3-EXL3", folder)          # a new revision (commit) of that folder
    with hub.serve("10.231.0.1") as url:                   # HF_ENDPOINT=url for the client
        snapshot_download("lab/GLM-5.3-EXL3", revision=sha, local_dir=..., endpoint=url)
    hub.bytes_served                                       # file bytes sent so far (the referee's count)

Routes, read from huggingface_hub's own source (hf_api.py, file_download.py, _snapshot_download.py):
  GET  /api/models/{repo}/revision/{rev}       repo_info: sha, siblings (sizes + LFS with ?blobs=true)
  GET  /api/models/{repo}/tree/{rev}[/{dir}]   list_repo_tree: files (size, oid, lfs.oid/size), folders
  HEAD /{repo}/resolve/{rev}/{path}            file metadata: X-Repo-Commit, ETag / X-Linked-Etag,
                                               X-Linked-Size, Content-Length
  GET  /{repo}/resolve/{rev}/{path}            the bytes, honouring `Range: bytes=N-` (206) for resume
*.safetensors files are LFS files, as on the Hub: their ETag is the content's sha256. Other files'
ETag is the git blob id. A revision is a 40-hex commit id; `main` (or any branch) names the latest.
With `token` set, every request must carry `Authorization: Bearer <token>` (else 401, as for a gated repo).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
CHUNK = 1024 * 1024


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _blob_id(path: Path) -> str:
    """git's blob id: sha1 of "blob <size>\\0" + content."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's id, not security
    with open(path, "rb") as f:
        while chunk := f.read(8 * CHUNK):
            h.update(chunk)
    return h.hexdigest()


class StandinHub:
    def __init__(self, root: Path, *, token: str | None = None) -> None:
        self.root = Path(root)
        self.token = token
        self.bytes_served = 0
        self.requests: list[str] = []  # "METHOD path" of every request, for tests
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- repositories
    def _repo(self, repo: str) -> Path:
        return self.root / repo

    def refs(self, repo: str) -> dict[str, str]:
        try:
            return dict(json.loads((self._repo(repo) / "refs.json").read_text()))
        except (OSError, ValueError):
            return {}

    def publish(self, repo: str, folder: Path, *, branch: str = "main") -> str:
        """Make `folder`'s files a new commit of `repo` on `branch`; returns its 40-hex id.
        Files are hard-linked when they can be (same filesystem), else copied."""
        folder = Path(folder)
        files: dict[str, dict[str, Any]] = {}
        for p in sorted(folder.rglob("*")):
            rel = p.relative_to(folder).as_posix()
            if not p.is_file() or any(part.startswith(".") for part in rel.split("/")):
                continue
            lfs = rel.endswith(".safetensors")
            files[rel] = {"size": p.stat().st_size, "oid": _blob_id(p) if not lfs else None,
                          "sha256": _sha256(p) if lfs else None}
        parent = self.refs(repo).get(branch, "")
        digest = hashlib.sha1(json.dumps([parent, files], sort_keys=True).encode())  # noqa: S324 - an id
        sha = digest.hexdigest()
        commit = self._repo(repo) / "commits" / sha
        if not commit.exists():
            tmp = commit.with_name(sha + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            for rel in files:
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(folder / rel, dst)
                except OSError:
                    shutil.copy2(folder / rel, dst)
            (tmp.parent / f"{sha}.json").write_text(json.dumps(files))
            tmp.rename(commit)
        refs = self.refs(repo)
        refs[branch] = sha
        (self._repo(repo) / "refs.json").write_text(json.dumps(refs))
        return sha

    def resolve(self, repo: str, rev: str) -> str | None:
        if COMMIT_RE.match(rev) and (self._repo(repo) / "commits" / rev).is_dir():
            return rev
        return self.refs(repo).get(rev)

    def files(self, repo: str, sha: str) -> dict[str, dict[str, Any]]:
        return dict(json.loads((self._repo(repo) / "commits" / f"{sha}.json").read_text()))

    def file_path(self, repo: str, sha: str, rel: str) -> Path:
        return self._repo(repo) / "commits" / sha / rel

    # ---------------------------------------------------------------- HTTP
    @contextmanager
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
        """Serve in a thread; yields the endpoint URL (for HF_ENDPOINT)."""
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        thread.start()
        try:
            yield f"http://{host}:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)

    def count(self, line: str, sent: int = 0) -> None:
        with self._lock:
            self.requests.append(line)
            self.bytes_served += sent


class _Handler(BaseHTTPRequestHandler):
    hub: StandinHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read hub.requests instead
        pass

    def _reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
               content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, code: int, message: str, kind: str = "EntryNotFound") -> None:
        self._reply(code, json.dumps({"error": message}).encode(), {"X-Error-Code": kind, "X-Error-Message": message})

    def _authorized(self) -> bool:
        want = self.hub.token
        if want is None:
            return True
        return self.headers.get("Authorization", "") == f"Bearer {want}"

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.hub.count(f"{self.command} {path}")
        if not self._authorized():
            self._error(401, "Invalid credentials in Authorization header", "GatedRepo")
            return
        m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$", path)
        if m:
            self._repo_info(m.group(1), m.group(2), "blobs=true" in (url.query or ""))
            return
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
        if m:
            self._tree(m.group(1), m.group(2), m.group(3) or "", "recursive=True" in (url.query or "")
                       or "recursive=true" in (url.query or ""))
            return
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            self._resolve(m.group(1), m.group(2), m.group(3))
            return
        self._error(404, f"no route for {path}", "RepoNotFound")

    def _commit(self, repo: str, rev: str) -> str | None:
        if not self.hub.refs(repo):
            self._error(404, f"Repository Not Found for url: {self.path}", "RepoNotFound")
            return None
        sha = self.hub.resolve(repo, rev)
        if sha is None:
            self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return sha

    def _entry(self, rel: str, meta: dict[str, Any]) -> dict[str, Any]:
        e: dict[str, Any] = {"type": "file", "path": rel, "size": meta["size"],
                             "oid": meta["oid"] or hashlib.sha1(meta["sha256"].encode()).hexdigest()}  # noqa: S324
        if meta["sha256"]:
            e["lfs"] = {"oid": meta["sha256"], "size": meta["size"], "pointerSize": 134}
        return e

    def _repo_info(self, repo: str, rev: str, blobs: bool) -> None:
        sha = self._commit(repo, rev)
        if sha is None:
            return
        siblings = []
        for rel, meta in self.hub.files(repo, sha).items():
            s: dict[str, Any] = {"rfilename": rel}
            if blobs:
                e = self._entry(rel, meta)
                s.update({"size": meta["size"], "blobId": e["oid"]})
                if "lfs" in e:
                    s["lfs"] = {"sha256": meta["sha256"], "size": meta["size"], "pointerSize": 134}
            siblings.append(s)
        doc = {"_id": repo, "id": repo, "modelId": repo, "sha": sha, "private": False, "disabled": False,
               "gated": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
               "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())}
        self._reply(200, json.dumps(doc).encode())

    def _tree(self, repo: str, rev: str, under: str, recursive: bool) -> None:
        sha = self._commit(repo, rev)
        if sha is None:
            return
        prefix = under.strip("/") + "/" if under.strip("/") else ""
        out: list[dict[str, Any]] = []
        folders: set[str] = set()
        for rel, meta in self.hub.files(repo, sha).items():
            if not rel.startswith(prefix):
                continue
            rest = rel[len(prefix):]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                folder = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and folder not in folders:
                    folders.add(folder)
                    out.append({"type": "directory", "path": folder, "size": 0,
                                "oid": hashlib.sha1(folder.encode()).hexdigest()})  # noqa: S324
            if recursive or len(parts) == 1:
                out.append(self._entry(rel, meta))
        self._reply(200, json.dumps(out).encode())

    def _resolve(self, repo: str, rev: str, rel: str) -> None:
        sha = self._commit(repo, rev)
        if sha is None:
            return
        meta = self.hub.files(repo, sha).get(rel)
        if meta is None:
            self._error(404, f"{rel} not found in {repo}@{sha}")
            return
        size = int(meta["size"])
        etag = meta["sha256"] or meta["oid"]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if meta["sha256"]:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)})
        start = 0
        m = re.match(r"^bytes=(\d+)-$", self.headers.get("Range", ""))
        if m and self.command == "GET":
            start = min(int(m.group(1)), size)
        code = 206 if start else 200
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        sent = 0
        with open(self.hub.file_path(repo, sha, rel), "rb") as f:
            f.seek(start)
            try:
                while chunk := f.read(CHUNK):
                    self.wfile.write(chunk)
                    sent += len(chunk)
            finally:
                self.hub.count(f"BYTES {rel}", sent)


def main(argv: list[str] | None = None) -> int:
    """`python -m sparkctl.lab.hfhub ROOT [--host H] [--port P]`: serve ROOT until interrupted."""
    import argparse

    ap = argparse.ArgumentParser(prog="sparkctl.lab.hfhub")
    ap.add_argument("root", type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    hub = StandinHub(args.root, token=os.environ.get("STANDIN_HUB_TOKEN") or None)
    with hub.serve(args.host, args.port) as url:
        print(f"HF_ENDPOINT={url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
