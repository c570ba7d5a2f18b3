"""Download a Hub repo at a pinned revision into DIR, on the node. No sparkctl imports.

Runs on the head as `HF_PYTHON -c BOOT N REPO REVISION DIR [--free-margin B]`, the script's N bytes
first on stdin and then one line with the token (empty line: none), so the token is on no command line
and in no environment a `ps` shows. Needs huggingface_hub (>= 0.24) on that python.

Protocol: progress lines on stderr (`@@progress {"bytes": n, "total": t}`), one JSON document on
stdout at the end:
  {"status": "up-to-date" | "downloaded" | "no-space" | "error", "repo", "revision", "commit",
   "total_bytes", "need_bytes", "free_bytes", "downloaded_bytes", "files", "seconds", "message"}

Up to date = the marker DIR/.sparkctl-model.json names this repo and commit and every listed file is
there with its listed size: then nothing is asked of the Hub when REVISION is a commit id (one small
call to resolve a branch name otherwise).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
from typing import Any

MARKER = ".sparkctl-model.json"
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
PROGRESS_EVERY = 1.0


def marker_path(root: str) -> str:
    return os.path.join(root, MARKER)


def read_marker(root: str) -> dict[str, Any] | None:
    try:
        with open(marker_path(root)) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, RecursionError):  # whoever writes MODEL writes the marker: nested absurdly deep
        return None


def write_marker(root: str, repo: str, commit: str, files: dict[str, int]) -> None:
    """The marker, whole or not at all: written to a temp file of its own (a new name, O_EXCL: never
    through a link someone who can write DIR planted) and renamed over the marker."""
    fd, tmp = tempfile.mkstemp(dir=root, prefix=MARKER + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump({"repo": repo, "revision": commit, "files": files, "written": int(time.time())}, f, indent=1)
        os.replace(tmp, marker_path(root))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def missing_files(root: str, files: dict[str, int]) -> dict[str, int]:
    """The listed files that are absent or of another size."""
    out = {}
    for rel, size in files.items():
        try:
            if os.path.getsize(os.path.join(root, rel)) == size:
                continue
        except OSError:
            pass
        out[rel] = size
    return out


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `path` (or would)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def bytes_on_disk(root: str, files: dict[str, int]) -> int:
    """What is there now of the listed files, partial downloads included."""
    total = 0
    for rel in files:
        for cand in (os.path.join(root, rel),
                     os.path.join(root, ".cache", "huggingface", "download", rel + ".incomplete")):
            try:
                total += os.path.getsize(cand)
            except OSError:
                continue
    incoming = os.path.join(root, ".cache", "huggingface", "download")
    if os.path.isdir(incoming):  # the client names partial files <etag>.incomplete in some versions
        for dirpath, _, names in os.walk(incoming):
            for n in names:
                if n.endswith(".incomplete") and not any(n == os.path.basename(r) + ".incomplete" for r in files):
                    try:
                        total += os.path.getsize(os.path.join(dirpath, n))
                    except OSError:
                        pass
    return total


def identities(root: str, files: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """(inode, mtime_ns, size) per present file: the client replaces a file it downloads (it writes
    aside and renames), so a changed identity afterwards means those bytes were fetched."""
    out = {}
    for rel in files:
        try:
            st = os.stat(os.path.join(root, rel))
        except OSError:
            continue
        out[rel] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def fetched(root: str, files: dict[str, int], before: dict[str, tuple[int, int, int]]) -> int:
    now = identities(root, files)
    return sum(v[2] for rel, v in now.items() if before.get(rel) != v)


def main(argv: list[str]) -> int:
    started = time.monotonic()
    repo, revision, root = argv[0], argv[1], os.path.abspath(argv[2])
    token = sys.stdin.readline().strip() or None
    sys.stdout.write("@@ready\n")
    sys.stdout.flush()
    doc: dict[str, Any] = {"repo": repo, "revision": revision, "dir": root, "downloaded_bytes": 0}

    def done(status: str, **kw: Any) -> int:
        doc.update(status=status, seconds=round(time.monotonic() - started, 3), **kw)
        sys.stdout.write(json.dumps(doc) + "\n")
        return 0 if status in ("up-to-date", "downloaded") else 1

    marker = read_marker(root)
    commit = revision if COMMIT_RE.match(revision) else None
    if commit and marker and marker.get("repo") == repo and marker.get("revision") == commit:
        files = {k: int(v) for k, v in (marker.get("files") or {}).items()}
        if files and not missing_files(root, files):
            return done("up-to-date", commit=commit, files=len(files), total_bytes=sum(files.values()),
                        need_bytes=0, free_bytes=free_bytes(root))
    try:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return done("error", code="no-huggingface-hub",
                    message=f"{sys.executable} cannot import huggingface_hub")
    disable_progress_bars()
    api = HfApi(token=token)
    try:
        if commit is None:
            info = api.repo_info(repo, revision=revision)
            commit = str(info.sha)
            if marker and marker.get("repo") == repo and marker.get("revision") == commit:
                files = {k: int(v) for k, v in (marker.get("files") or {}).items()}
                if files and not missing_files(root, files):
                    return done("up-to-date", commit=commit, files=len(files), total_bytes=sum(files.values()),
                                need_bytes=0, free_bytes=free_bytes(root))
        listing = {f.path: int(getattr(f, "size", 0) or 0)
                   for f in api.list_repo_tree(repo, revision=commit, recursive=True)
                   if type(f).__name__ == "RepoFile"}
    except Exception as exc:  # the Hub said no: name it, never the token
        return done("error", code=type(exc).__name__, message=str(exc).splitlines()[0][:400] if str(exc) else "")
    total = sum(listing.values())
    need = sum(missing_files(root, listing).values())
    free = free_bytes(root)
    doc.update(commit=commit, files=len(listing), total_bytes=total, need_bytes=need, free_bytes=free)
    if need > free:
        return done("no-space", message=f"{need} bytes to download, {free} free")
    before = bytes_on_disk(root, listing)
    ids = identities(root, listing)
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(PROGRESS_EVERY):
            now = bytes_on_disk(root, listing)
            sys.stderr.write("@@progress " + json.dumps({"bytes": max(0, now - before), "total": need}) + "\n")
            sys.stderr.flush()

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        os.makedirs(root, exist_ok=True)
        snapshot_download(repo, revision=commit, local_dir=root, token=token)
    except Exception as exc:
        return done("error", code=type(exc).__name__, message=str(exc).splitlines()[0][:400] if str(exc) else "",
                    downloaded_bytes=fetched(root, listing, ids))
    finally:
        stop.set()
    left = missing_files(root, listing)
    if left:
        return done("error", code="incomplete", message=f"{len(left)} file(s) missing after the download: "
                    + ", ".join(sorted(left)[:5]))
    write_marker(root, repo, commit, listing)
    return done("downloaded", downloaded_bytes=fetched(root, listing, ids))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
