"""Read what sparkctl needs from a Dockerfile it did not write (the checkpoint's `serving/Dockerfile.*`).

Pure. Two questions only:
- which build argument names the parent image: an `ARG X` (default or not) before the first `FROM`,
  used by a `FROM ${X}` / `FROM $X`. The chain passes the previous layer's image through it; a file that
  starts FROM a fixed image cannot be chained and is refused with what it would need.
- which context files it copies: the sources of `COPY`/`ADD` (not `--from=` copies of another stage or
  image, not URLs), so the content hash covers exactly what the build reads from `serving/`.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

_ARG_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:=.*)?$")
_REF_RE = re.compile(r"^\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))$")


@dataclass(frozen=True)
class DockerfileInfo:
    base_arg: str | None  # the build argument the final stage's FROM takes its image from
    first_from: str  # the final stage's FROM image as written (for the error when base_arg is None)
    sources: tuple[str, ...]  # COPY/ADD sources from the build context, as written


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs: comments and blank lines dropped, `\\` continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    if pending.strip():
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _copy_sources(rest: str) -> list[str]:
    """The context sources of one COPY/ADD (shell or JSON form); [] for `--from=` copies."""
    flags: list[str] = []
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.lstrip()
    if any(f.startswith("--from=") for f in flags):
        return []
    words: list[str] | None = None
    if rest.startswith("["):
        try:
            words = [str(w) for w in json.loads(rest)]
        except json.JSONDecodeError:
            words = None
    if words is None:
        words = shlex.split(rest)
    return [s for s in words[:-1] if "://" not in s]


def parse(text: str) -> DockerfileInfo:
    pre_from_args: set[str] = set()
    seen_from = False
    final_from = ""
    base_arg: str | None = None
    stage_arg: dict[str, str | None] = {}  # `FROM x AS name`: the parent argument stage `name` rests on
    sources: list[str] = []
    for word, rest in instructions(text):
        if word == "ARG" and not seen_from:
            for item in rest.split():
                m = _ARG_RE.match(item)
                if m:
                    pre_from_args.add(m.group(1))
        elif word == "FROM":
            seen_from = True
            words = [w for w in rest.split() if not w.startswith("--")]
            image = words[0] if words else ""
            final_from = image
            m = _REF_RE.match(image)
            name = (m.group(1) or m.group(2)) if m else None
            base_arg = name if name in pre_from_args else stage_arg.get(image.lower())
            if len(words) >= 3 and words[1].upper() == "AS":
                stage_arg[words[2].lower()] = base_arg
        elif word in ("COPY", "ADD"):
            sources.extend(_copy_sources(rest))
    return DockerfileInfo(base_arg, final_from, tuple(sources))


def match_sources(sources: Iterable[str], files: Iterable[str]) -> tuple[list[str], list[str]]:
    """(context files the sources select, sources that select nothing). `files` are paths relative to
    the context; a source is a file, a folder (everything under it), or a glob."""
    files = sorted(files)
    picked: dict[str, None] = {}
    unmatched: list[str] = []
    for src in sources:
        norm = src.strip().lstrip("/")
        while norm.startswith("./"):
            norm = norm[2:]
        norm = norm.rstrip("/")
        if norm in ("", "."):
            hits = files
        else:
            hits = [f for f in files if f == norm or f.startswith(norm + "/") or fnmatch.fnmatchcase(f, norm)]
        if not hits:
            unmatched.append(src)
        picked.update(dict.fromkeys(hits))
    return sorted(picked), unmatched
