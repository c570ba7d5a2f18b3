"""The base image, pinned: resolved on the head, the same image on every rank. Pure (no I/O).

A recipe names its base by a tag (BASE_IMAGE, e.g. Mia's `...:exl3`), and tags move: a rank that
pulled it at another time holds another image, its chain gets another content hash, and `check`
sends the user to `build`, which must not skip the rank as "base present" (a loop). So `build`
resolves the tag **on the head** into a pin: the head's image ID, and the `repo@sha256:` digest it
was pulled as (RepoDigests), when it has one. Every rank must then hold that very image:

- identity is the image ID (the config's digest), which a pull, a tag and `docker save | docker load`
  all keep; RepoDigests are not compared, because `save | load` drops them;
- a rank whose base differs or is missing is fixed by one `build`: it pulls the pin by digest and
  tags it as BASE_IMAGE when the head has a digest, else (a base built or loaded locally, as in the
  lab) it is sent the head's base, only the layers it lacks, as `--ship` sends the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..facts.docker_parse import Image, normalize_image_ref


@dataclass(frozen=True)
class BaseIdentity:
    ref: str  # BASE_IMAGE as configured (a tag, or already repo@sha256:...)
    id: str  # the head's image ID for it
    digest: str | None  # repo@sha256:... the head pulled it as; None when it has none

    def describe(self) -> str:
        return self.digest or f"image ID {self.id.removeprefix('sha256:')[:12]}"

    def as_dict(self) -> dict[str, str | None]:
        return {"ref": self.ref, "id": self.id, "digest": self.digest}


def repo_of(ref: str) -> str:
    """`ghcr.io/a/b:tag` / `ghcr.io/a/b@sha256:x` -> `ghcr.io/a/b` (Docker Hub names without docker.io/library)."""
    if "@" in ref:
        ref = ref.split("@", 1)[0]
    return normalize_image_ref(ref).rsplit(":", 1)[0]


def identify(ref: str, head_image: Image) -> BaseIdentity:
    """The head's base as the pin every rank must match."""
    repo = repo_of(ref)
    digests = [d for d in head_image.repo_digests if d.split("@", 1)[0] == repo] or list(head_image.repo_digests)
    return BaseIdentity(ref, head_image.id, digests[0] if digests else None)


def stale(p: BaseIdentity, image: Image | None, what: str = "base") -> str | None:
    """Why a rank's base (or prebuilt image: `what`) is not the pin (None: it is)."""
    if image is None:
        return f"{what} image {p.ref} is not on the node"
    if image.id != p.id:
        return (f"{what} image {p.ref} is {image.id.removeprefix('sha256:')[:12]}, the head's is "
                f"{p.id.removeprefix('sha256:')[:12]}" + (f" ({p.digest})" if p.digest else ""))
    return None
