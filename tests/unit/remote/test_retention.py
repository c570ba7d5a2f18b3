"""`build`'s retention sweep (retention.py) run by the real `sh` against a stateful stand-in for the `docker` CLI.

The stand-in keeps images as Docker does (an ID, its tags, its labels, its creation time) and answers the
calls the sweep makes the way Docker's CLI does: `image inspect --format` with `index .Config.Labels`,
`tag`, `images --filter reference=PATTERN --format` (a glob over `repo:tag`, `*` not crossing `/`, as the
daemon's reference filter matches), `rmi TAG` (untags; the image goes with its last tag) and `image prune
-f --filter label=...` (dangling images only). Every call is logged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sparkctl.remote.retention import retain_argv

FAKE = r'''
import fnmatch, json, os, re, sys
state_path, log = os.environ["STATE"], os.environ["LOG"]
with open(log, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\n")
images = json.load(open(state_path))
argv = sys.argv[1:]

def find(ref):
    return next((i for i in images if ref in i["tags"]), None)

def render(template, img):
    def one(m):
        return img["labels"].get(m.group(1), "<no value>")
    return re.sub(r'\{\{index \.Config\.Labels "([^"]+)"\}\}', one, template)

def save():
    json.dump(images, open(state_path, "w"))

if argv[:2] == ["image", "inspect"]:
    fmt, ref = argv[argv.index("--format") + 1], argv[-1]
    img = find(ref)
    if img is None:
        print("Error: No such image: " + ref, file=sys.stderr); sys.exit(1)
    print(render(fmt, img)); sys.exit(0)
if argv[0] == "tag":
    img = find(argv[1])
    if img is None:
        print("Error response from daemon: No such image: " + argv[1], file=sys.stderr); sys.exit(1)
    for other in images:
        if argv[2] in other["tags"]:
            other["tags"].remove(argv[2])
    img["tags"].append(argv[2]); save(); sys.exit(0)
if argv[0] == "images":
    pattern = argv[argv.index("--filter") + 1].removeprefix("reference=")
    fmt = argv[argv.index("--format") + 1]
    for img in images:
        for t in img["tags"]:
            if fnmatch.fnmatchcase(t, pattern) and "/" not in t[len(pattern.split("*")[0]):]:
                repo, tag = t.rsplit(":", 1)
                print(fmt.replace("{{.CreatedAt}}", img["created"]).replace("{{.Repository}}", repo)
                      .replace("{{.Tag}}", tag).replace("{{.ID}}", img["id"][7:19]))
    sys.exit(0)
if argv[0] == "rmi":
    img = find(argv[1])
    if img is None:
        print("Error response from daemon: No such image: " + argv[1], file=sys.stderr); sys.exit(1)
    img["tags"].remove(argv[1])
    if not img["tags"]:
        images.remove(img)
    save(); sys.exit(0)
if argv[:2] == ["image", "prune"]:
    want = [argv[i + 1].removeprefix("label=") for i, w in enumerate(argv) if w == "--filter"]
    def has(img, w):
        k, _, v = w.partition("=")
        return k in img["labels"] and (not _ or img["labels"][k] == v)
    images[:] = [i for i in images if i["tags"] or not all(has(i, w) for w in want)]
    save(); sys.exit(0)
print("fake docker: unexpected " + " ".join(argv), file=sys.stderr)
sys.exit(9)
'''

HASH = "0123456789abcdef" * 4  # the content hash of today's keys3 image


def image(n: int, tags: list[str], labels: dict[str, str]) -> dict[str, Any]:
    return {"id": f"sha256:{n:064x}", "tags": tags, "labels": labels,
            "created": f"2026-11-{n:02d} 00:00:00 +0000 UTC"}


def ours(layer: str, chash: str, recipe: str = "lab") -> dict[str, str]:
    return {"sparkctl.recipe": recipe, "sparkctl.layer": layer, "sparkctl.content-hash": f"sha256:{chash}"}


def sweep(tmp_path: Path, images: list[dict[str, Any]], *, keep: int = 3,
          tags: tuple[str, ...] = ("r/chain:keys3",)) -> tuple[subprocess.CompletedProcess[str], set[str], list[Any]]:
    """Run retention's script as `build` runs it on a node; (the run, every tag left, the docker calls)."""
    (tmp_path / "docker").write_text(f"#!{sys.executable}\n{FAKE}")
    (tmp_path / "docker").chmod(0o755)
    (tmp_path / "state.json").write_text(json.dumps(images))
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "STATE": str(tmp_path / "state.json"), "LOG": str(tmp_path / "log")}
    r = subprocess.run(retain_argv(keep, "lab", list(tags)), env=env, capture_output=True, text=True, timeout=60)
    left = {t for i in json.loads((tmp_path / "state.json").read_text()) for t in i["tags"]}
    calls = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    return r, left, calls


def old_chain(start: int, count: int) -> list[dict[str, Any]]:
    """`count` earlier keys3 builds, each tagged only by its hash tag (oldest first)."""
    out = []
    for k in range(count):
        chash = f"{start + k:02d}" + "ab" * 31
        out.append(image(start + k, [f"r/chain:keys3-{chash[:12]}"], ours("keys3", chash)))
    return out


def test_retention_tags_by_hash_keeps_the_newest_and_prunes_only_its_own_dangling(tmp_path: Path) -> None:
    older = old_chain(1, 4)
    images = [*older, image(20, ["r/chain:keys3"], ours("keys3", HASH)),
              image(21, ["r/chain:dcp"], {}),  # no content-hash label: not built by sparkctl, never tagged
              image(5, [], ours("keys3", "cd" * 32)),  # this recipe's dangling image: pruned
              image(6, [], ours("keys3", "ef" * 32, recipe="other")),  # another recipe's: stays
              image(7, [], {})]  # an unlabelled dangling image: stays
    r, left, calls = sweep(tmp_path, images, tags=("r/chain:dcp", "r/chain:keys3"))
    assert r.returncode == 0, r.stderr
    assert ["tag", "r/chain:keys3", f"r/chain:keys3-{HASH[:12]}"] in calls
    assert not any(c[0] == "tag" and c[1] == "r/chain:dcp" for c in calls)
    kept = {f"r/chain:keys3-{HASH[:12]}", *(i["tags"][0] for i in older[-2:])}  # today's + the 2 newest before
    assert left == kept | {"r/chain:keys3", "r/chain:dcp"}
    assert r.stdout.split("\n")[:-1] == [f"removed {i['tags'][0]}" for i in reversed(older[:2])]
    ids = {i["id"] for i in json.loads((tmp_path / "state.json").read_text())}
    assert image(5, [], {})["id"] not in ids and {image(6, [], {})["id"], image(7, [], {})["id"]} <= ids


def test_retention_never_removes_a_tag_it_did_not_make(tmp_path: Path) -> None:
    """Only `<tag>-<12 lowercase hex>` tags of an image whose labels say this recipe, this layer and that very
    content hash are the sweep's; a user's own tags beside them stay, however old and however many."""
    chain = old_chain(10, 3)
    user = [
        image(1, ["r/chain:keys3-known-good"], ours("keys3", "11" * 32)),  # a user's name for an old build
        image(2, ["r/chain:keys3-backup"], {}),
        image(3, ["r/chain:keys3-0123456789ab"], {}),  # hash-shaped, but no label of ours
        image(4, ["r/chain:keys3-ABCDEF012345"], ours("keys3", "abcdef012345" + "0" * 52)),  # upper case
        image(5, ["r/chain:keys3-abcdef0123456"], ours("keys3", "abcdef0123456" + "0" * 51)),  # 13 hex
        image(6, ["r/chain:keys3-456789abcdef"], ours("keys3", "99" * 32)),  # its label's hash is another
        image(7, ["r/chain:keys3-777777777777"], ours("keys3", "7" * 64, recipe="other")),  # another recipe's
        image(8, ["r/chain:keys3-888888888888"], ours("dcp", "8" * 64)),  # another layer's
        image(9, ["r/chain:keys3-x-999999999999"], ours("keys3", "9" * 64)),  # a dash before the hash
    ]
    r, left, calls = sweep(tmp_path, [*user, *chain, image(30, ["r/chain:keys3"], ours("keys3", HASH))], keep=1)
    assert r.returncode == 0, r.stderr
    assert {t for u in user for t in u["tags"]} <= left, sorted({t for u in user for t in u["tags"]} - left)
    assert [c[1] for c in calls if c[0] == "rmi"] == [i["tags"][0] for i in reversed(chain)]
    assert left == {t for u in user for t in u["tags"]} | {"r/chain:keys3", f"r/chain:keys3-{HASH[:12]}"}


def test_retention_leaves_a_chain_tag_that_another_recipe_built(tmp_path: Path) -> None:
    """The chain's own tag carrying another recipe's labels (the user reused the tag prefix) is not ours: it is
    neither tagged nor trimmed."""
    other = image(9, ["r/chain:keys3"], ours("keys3", HASH, recipe="other"))
    older = image(1, [f"r/chain:keys3-{'12' * 6}"], ours("keys3", "12" * 32, recipe="other"))
    r, left, calls = sweep(tmp_path, [other, older], keep=1)
    assert r.returncode == 0, r.stderr
    assert left == {"r/chain:keys3", f"r/chain:keys3-{'12' * 6}"}
    assert not [c for c in calls if c[0] in ("tag", "rmi")]
