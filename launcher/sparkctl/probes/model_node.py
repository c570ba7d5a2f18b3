"""What `model pull` / `model sync` need to know about MODEL on a node, in one round trip. STDLIB ONLY.

Runs as `python3 - DIR < model_node.py`; prints one JSON document:
  dir, exists, free_bytes (for an unprivileged writer, on the filesystem that holds DIR or would),
  identity    [inode, ctime_ns] of DIR: equal on two nodes only when both see the same folder
              (an NFS view of the head's export, a bind mount); a copy never has the head's ctime
  mount       the mount DIR lives on: mountpoint, fstype, source (from /proc/self/mountinfo)
  marker      DIR/.sparkctl-model.json (repo, revision, files) or null
  partial     files and bytes in DIR/.sparkctl-partial (a sync interrupted there, resumable)
  rsync       the path of rsync on this node, or null
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

MARKER = ".sparkctl-model.json"
PARTIAL_DIR = ".sparkctl-partial"


def _existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def mount_of(path: str, mountinfo: str) -> dict[str, str]:
    """The longest mountpoint that contains `path`, from /proc/self/mountinfo text."""
    best: dict[str, str] = {"mountpoint": "/", "fstype": "?", "source": "?"}
    best_len = -1
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        mp = fields[4].replace("\\040", " ")
        inside = path == mp or path.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= best_len:  # later lines of the same length win: they are on top
            best, best_len = {"mountpoint": mp, "fstype": rest[0], "source": rest[1]}, len(mp)
    return best


def describe(directory: str) -> dict[str, Any]:
    root = os.path.abspath(directory)
    there = _existing(root)
    st = os.statvfs(there)
    doc: dict[str, Any] = {"dir": root, "exists": os.path.isdir(root), "free_bytes": st.f_bavail * st.f_frsize,
                           "identity": None, "marker": None, "partial": {"files": 0, "bytes": 0},
                           "rsync": shutil.which("rsync")}
    try:
        with open("/proc/self/mountinfo") as f:
            doc["mount"] = mount_of(os.path.realpath(there), f.read())
    except OSError:
        doc["mount"] = None
    if doc["exists"]:
        s = os.stat(root)
        doc["identity"] = [s.st_ino, s.st_ctime_ns]
        try:
            with open(os.path.join(root, MARKER)) as f:
                m = json.load(f)
            doc["marker"] = {"repo": m.get("repo"), "revision": m.get("revision"),
                             "files": len(m.get("files") or {})} if isinstance(m, dict) else None
        except (OSError, ValueError, RecursionError):  # a marker nested absurdly deep: none
            pass
        for dirpath, _, names in os.walk(os.path.join(root, PARTIAL_DIR)):
            for n in names:
                try:
                    doc["partial"]["bytes"] += os.path.getsize(os.path.join(dirpath, n))
                    doc["partial"]["files"] += 1
                except OSError:
                    pass
    return doc


if __name__ == "__main__":
    sys.stdout.write(json.dumps(describe(sys.argv[1])) + "\n")
