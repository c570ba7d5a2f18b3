"""What ran: every service `up` started, recorded on the head, for `history` and `rollback`.

Each started service appends one JSON line to `~/.sparkctl/<cluster>/history.jsonl` on the head
(the last HISTORY_KEEP are kept) and one `release` line to every node's audit log. A line holds the
image reference and its content hash, the config hash, the rendered env.tp4 (it never holds secrets)
and every non-secret knob as it was resolved, so `rollback` can bring that service back through `up`.

Images: `build` tags every chain image also with its content hash, `<IMAGE>-<hash12>`
(`sparkctl-lab/chain:keys3-1a2b3c4d5e6f`); that tag never moves, so it names one image forever.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from ..cluster import Cluster, Node, NodeError
from ..errors import UsageError
from ..facts.docker_parse import parse_content_hash
from ..facts.parsing import ParseError, parse_json
from ..spec.builders import LABEL_CONTENT_HASH
from ..spec.renderer import Rendered
from ..spec.settings import KNOBS, RANK_KEY_RE, Settings, is_secret, known_key, prefixes_of
from .lockdir import audit_line, now_iso, state_dir, whoami

HISTORY_KEEP = 50
MAX_LINE = 256 * 1024  # one entry is a few KB (env.tp4 included); more is not ours
_HEX12 = re.compile(r"^[0-9a-f]{12,64}$")

_APPEND = r'''f="$1"; n="$2"
umask 077 && mkdir -p -- "${f%/*}" || exit 3
cat >> "$f" || exit 3
tail -n "$n" -- "$f" > "$f.tmp" && mv -f -- "$f.tmp" "$f"'''
_READ = r'''f="$1"; [ -f "$f" ] && cat -- "$f" || true'''


def history_file(cluster: str) -> str:
    return f"{state_dir(cluster)}/history.jsonl"


def hash_tag(image: str, content_hash: str) -> str:
    """The immutable tag of a chain image: its mutable tag plus `-<hash12>` (`repo:keys3-1a2b…`)."""
    repo, _, tag = image.rpartition(":")
    if not repo or "/" in tag:  # no tag at all: docker's implicit `latest`
        repo, tag = image, "latest"
    suffix = f"-{content_hash[:12]}"
    return f"{repo}:{tag}" if tag.endswith(suffix) else f"{repo}:{tag}{suffix}"


def image_override(s: Settings, ref: str) -> str:
    """`up --image REF`: a tag or image reference as given, or a content hash (12+ hex) as its tag."""
    from ..spec.settings import IMAGE_RE  # the same rule as the IMAGE knob

    ref = ref.strip()
    if _HEX12.match(ref.removeprefix("sha256:")) and not _HEX12.match(ref):  # sha256:<content hash>
        ref = ref.removeprefix("sha256:")
    if _HEX12.match(ref):
        return hash_tag(s.image, ref)
    if not IMAGE_RE.match(ref):
        raise UsageError(f"--image {ref!r} is neither a Docker image reference nor a content hash (12+ hex)",
                         fix="give a tag such as sparkctl-lab/chain:keys3-1a2b3c4d5e6f, or a hash from "
                             "`sparkctl history`")
    return ref


def knob_snapshot(s: Settings) -> dict[str, str]:
    """Every non-secret knob as resolved now, "" for unset ones (so a rollback unsets them too).
    Per-rank fabric pins are left out: `up` resolves them again on the nodes (the GID index drifts)."""
    out = {k: "" for k in KNOBS if not is_secret(k)}
    for key, v in s.values.items():
        if is_secret(key) or RANK_KEY_RE.match(key):
            continue
        out[key] = v.raw
    return out


def content_hash_on(node: Node, image: str) -> str | None:
    r = node.docker(["image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL_CONTENT_HASH}"}}}}',
                     image], timeout=30)
    return parse_content_hash(r.stdout) if r.ok else None


def record_release(cluster: Cluster, s: Settings, rendered: Rendered, *, source: str) -> dict[str, Any]:
    """Append what `up` just started to the head's history and every node's audit log."""
    image = s.image
    head = cluster.node(s.head)
    chash = content_hash_on(head, image)
    entry: dict[str, Any] = {
        "when": now_iso(), "who": whoami(), "source": source, "config_hash": rendered.config_hash,
        "image": image, "image_content_hash": chash, "recipe": s.recipe.name,
        "env_sha256": hashlib.sha256(rendered.env_tp4.encode()).hexdigest(),
        "env_tp4": rendered.env_tp4, "knobs": knob_snapshot(s),
    }
    line = json.dumps(entry, sort_keys=True) + "\n"
    head.run(["sh", "-c", _APPEND, "sparkctl-history", history_file(s.cluster_name), str(HISTORY_KEEP)],
             stdin=line.encode(), timeout=20)
    detail = (f"image {image} content {chash or 'unknown'} env sha256:{entry['env_sha256'][:16]} "
              f"(by {source})")
    from .service import audit

    audit(cluster, s.nodes, s.cluster_name,
          {n: [audit_line(action="release", config_hash=rendered.config_hash, detail=detail)] for n in s.nodes})
    return entry


@dataclass(frozen=True)
class Release:
    """One history entry as read back from the head (untrusted: checked field by field)."""

    n: int  # 1 = the newest
    when: str
    who: str
    source: str
    config_hash: str
    image: str
    image_content_hash: str | None
    knobs: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "knobs"}


def parse_history(text: str) -> list[Release]:
    """Newest first. Lines that are not entries we wrote are skipped, never an error."""
    found: list[dict[str, Any]] = []
    for line in text.splitlines()[-HISTORY_KEEP * 4:]:
        if len(line) > MAX_LINE:
            continue
        try:
            doc = parse_json(line)
        except ParseError:
            continue
        if isinstance(doc, dict):
            found.append(doc)
    out: list[Release] = []
    for doc in reversed(found):
        strs = {k: doc.get(k) for k in ("when", "who", "source", "config_hash", "image")}
        knobs = doc.get("knobs")
        if not all(isinstance(v, str) for v in strs.values()) or not isinstance(knobs, dict):
            continue
        chash = doc.get("image_content_hash")
        out.append(Release(
            n=len(out) + 1, when=str(strs["when"])[:64], who=str(strs["who"])[:256],
            source=str(strs["source"])[:64], config_hash=str(strs["config_hash"])[:64],
            image=str(strs["image"])[:512],
            image_content_hash=chash[:64] if isinstance(chash, str) and _HEX12.match(chash) else None,
            knobs={str(k)[:64]: v for k, v in knobs.items() if isinstance(v, str) and _kept(str(k), knobs)},
        ))
    return out


def _kept(key: str, knobs: dict[Any, Any]) -> bool:
    """A stored knob worth bringing back: a knob, or a key of a family the release's CONTAINER_ENV_PREFIXES named;
    never a secret nor a rank pin (`up` resolves the pins again)."""
    declared = knobs.get("CONTAINER_ENV_PREFIXES")
    prefixes = prefixes_of(declared) if isinstance(declared, str) else ()
    return known_key(key, prefixes) and not is_secret(key) and not RANK_KEY_RE.match(key)


def read_history(head: Node, cluster: str) -> list[Release]:
    r = head.run(["sh", "-c", _READ, "sparkctl-history", history_file(cluster)], timeout=20)
    if not r.ok:
        raise NodeError(head.name, "history", f"cannot read {history_file(cluster)}: {r.stderr.strip()[:200]}")
    return parse_history(r.stdout)


def pick(releases: list[Release], to: str | None) -> Release:
    """`rollback` with no --to: the newest that is not the newest service. --to N: the N-th newest (1 = the newest).
    --to HASH: the newest whose config hash or image content hash starts with HASH."""
    if not releases:
        raise UsageError("this cluster has no history yet: `up` records every service it starts",
                         fix="bring a service up first; `sparkctl history` lists what ran")
    if to is None:  # the newest service that differs from the newest one (a watch restart repeats it)
        def what(r: Release) -> tuple[str, str]:
            return r.config_hash, r.image_content_hash or r.image

        for r in releases[1:]:
            if what(r) != what(releases[0]):
                return r
        raise UsageError("every service in the history is the one that ran last: nothing to roll back to",
                         fix="`sparkctl history` lists what ran")
    if to.isdigit() and len(to) <= 4:  # an entry number; a hash is given with 6+ characters
        n = int(to)
        if not 1 <= n <= len(releases):
            raise UsageError(f"--to {n}: the history has entries 1..{len(releases)} (1 = the newest)")
        return releases[n - 1]
    low = to.lower().removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{6,64}", low):
        raise UsageError(f"--to {to!r}: give an entry number or a config/content hash (6+ hex characters)")
    for r in releases:
        if r.config_hash.startswith(low) or (r.image_content_hash or "").startswith(low):
            return r
    raise UsageError(f"--to {to}: no history entry has that config or content hash",
                     fix="`sparkctl history` lists what ran")


def rollback_overrides(release: Release, current_hash: str | None = None) -> dict[str, str]:
    """The knobs that bring `release` back, as they were. The image: its own reference while that still
    names the same content (`current_hash`, read on the head: then the config hash is the recorded
    one), else its content-hash tag (the mutable tag has moved on to a newer build)."""
    knobs = dict(release.knobs)
    moved = release.image_content_hash is not None and current_hash != release.image_content_hash
    knobs["IMAGE"] = hash_tag(release.image, str(release.image_content_hash)) if moved else release.image
    return knobs
