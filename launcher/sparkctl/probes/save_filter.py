"""sparkctl ship, on the head: unpack `docker save` (a tar on stdin) into DIR, keeping of the layers
only those some rank lacks.

    docker save TAG... | python3 -c "$(cat save_filter.py)" DIR [sha256:DIFF_ID ...]

Unpacking the whole save, base image included, would write a 20 GB base's 20 GB to the head's disk
(and need the room for it) on every ship, for layers no rank needs. This writes every
small file (manifest.json, the image configs, repositories, index.json, the legacy VERSION/json files)
and, of the layers:
  - legacy layout (`<id>/layer.tar`, Docker < 25): the layer is written while hashed; its sha256 is its
    diff ID; one that is not NEEDED is removed at once (so the disk holds one unneeded layer at most);
  - OCI layout (`blobs/sha256/<digest>`, Docker >= 25): a large blob that is a plain tar is a layer
    whose digest is its diff ID: one that is not NEEDED is not written at all. A compressed blob
    (containerd's image store) cannot be told by its name and is kept, as anything not understood is:
    the filter never drops what might be needed.
Member names are checked against the shapes `docker save` writes: nothing is written outside DIR.
Prints one line: "kept K skipped S bytes_skipped B".
"""

import hashlib
import os
import re
import sys
import tarfile
from typing import IO

SAFE = re.compile(
    r"(?:manifest\.json|repositories|index\.json|oci-layout|[0-9a-f]{64}\.json"
    r"|[0-9a-f]{64}(?:/(?:VERSION|json|layer\.tar))?|blobs(?:/sha256(?:/[0-9a-f]{64})?)?)"
)
LEGACY_LAYER = re.compile(r"[0-9a-f]{64}/layer\.tar")
BLOB = re.compile(r"blobs/sha256/([0-9a-f]{64})")
LINK = re.compile(r"\.\./[0-9a-f]{64}/layer\.tar")
SMALL = 4 << 20  # configs and manifests are kilobytes; anything this small is kept unexamined
CHUNK = 1 << 20


def plain_tar(head: bytes) -> bool:
    return len(head) >= 262 and head[257:262] == b"ustar"


def copy(src: IO[bytes], path: str, first: bytes = b"") -> str:
    """Write first + the rest of src to path; return the sha256 hex of what was written."""
    digest = hashlib.sha256(first)
    with open(path, "xb") as out:
        out.write(first)
        while True:
            block = src.read(CHUNK)
            if not block:
                break
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: save_filter DIR [sha256:DIFF_ID ...]")
    root, needed = argv[0], set(argv[1:])
    kept = skipped = skipped_bytes = 0
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        for member in tar:
            name = member.name[2:] if member.name.startswith("./") else member.name
            name = name.rstrip("/")
            if not name:
                continue
            if not SAFE.fullmatch(name):
                raise SystemExit(f"unexpected member {member.name!r} in docker save output")
            path = os.path.join(root, name)
            if member.isdir():
                os.makedirs(path, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(path) or root, exist_ok=True)
            if member.issym():  # legacy: a layer two images share is written once, linked from the other
                if not LINK.fullmatch(member.linkname):
                    raise SystemExit(f"unexpected link {member.name!r} -> {member.linkname!r}")
                os.symlink(member.linkname, path)
                continue
            if not member.isfile():
                raise SystemExit(f"unexpected member type {member.name!r}")
            src = tar.extractfile(member)
            if src is None:
                raise SystemExit(f"cannot read {member.name!r}")
            blob = BLOB.fullmatch(name)
            if blob and member.size > SMALL and "sha256:" + blob.group(1) not in needed:
                head = src.read(512)
                if plain_tar(head):  # an uncompressed layer: its name is its diff ID, and not needed
                    skipped += 1
                    skipped_bytes += member.size
                    continue
                copy(src, path, head)
                kept += 1
                continue
            digest = copy(src, path)
            if LEGACY_LAYER.fullmatch(name) and "sha256:" + digest not in needed:
                os.unlink(path)
                skipped += 1
                skipped_bytes += member.size
                continue
            kept += 1
    print(f"kept {kept} skipped {skipped} bytes_skipped {skipped_bytes}")


if __name__ == "__main__":
    main(sys.argv[1:])
