"""After `build`: pin every chain image by its content hash, keep the last BUILD_KEEP_CHAINS, clean up.

The mutable tags (`…:keys3`) move with every build, so the previous image would be lost for rollback.
Each chain image is therefore also tagged `<tag>-<hash12>` (its `sparkctl.content-hash` label; equal on
every rank for the same inputs). Per layer, hash tags beyond the newest BUILD_KEEP_CHAINS are removed
(`docker rmi` by tag: an image a container still uses stays), and then this recipe's own dangling
images (untagged, with our content-hash label: e.g. what `build --ship` superseded) are pruned.
A hash tag is exactly `<tag>-<12 lowercase hex>` on an image labelled with this recipe, that layer and a
content hash beginning with those 12 digits: a user's own `<tag>-known-good` (or any tag that merely
looks like ours) is never removed, nor counted among the kept. Nothing without both our recipe and
content-hash labels, or outside the chain's own tags, is touched.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cluster import Node, NodeError
from ..spec.builders import LABEL_CONTENT_HASH, LABEL_RECIPE

DEFAULT_KEEP = 3

# $1 keep, $2 recipe, then the chain's tags. Prints one line per hash tag it removed ("removed TAG").
# A tag is the sweep's only when it is exactly `<chain tag>-<12 lowercase hex>` and its image's labels say this
# recipe, the chain tag's layer and a content hash that begins with those 12 digits (labels: hash|layer|recipe;
# the hash is hex and a layer name has no `|`, so the split is exact). Anything else is a user's and stays.
_RETAIN = r'''keep="$1"; recipe="$2"; shift 2
fmt='{{index .Config.Labels "sparkctl.content-hash"}}|{{index .Config.Labels "sparkctl.layer"}}|{{index .Config.Labels "sparkctl.recipe"}}'
hex12='[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]'
for t in "$@"; do
  mine=$(docker image inspect --format "$fmt" "$t" 2>/dev/null) || continue
  h=${mine%%|*}; h=${h#sha256:}; rest=${mine#*|}; layer=${rest%%|*}
  [ "${rest#*|}" = "$recipe" ] || continue
  case "$h" in *[!0-9a-f]*|'') continue ;; esac
  h=$(printf '%.12s' "$h")
  case "$h" in $hex12) ;; *) continue ;; esac
  docker tag "$t" "$t-$h" || exit 3
  docker images --filter "reference=$t-*" --format '{{.CreatedAt}}	{{.Repository}}:{{.Tag}}' \
    | sort -r | cut -f2 | {
      n=0
      while IFS= read -r old; do
        s=${old#"$t-"}
        [ "$old" = "$t-$s" ] || continue
        case "$s" in $hex12) ;; *) continue ;; esac
        got=$(docker image inspect --format "$fmt" "$old" 2>/dev/null) || continue
        gh=${got%%|*}; gh=${gh#sha256:}
        [ "${got#*|}" = "$layer|$recipe" ] && [ "$(printf '%.12s' "$gh")" = "$s" ] || continue
        n=$((n + 1))
        [ "$n" -gt "$keep" ] || continue
        docker rmi "$old" >/dev/null 2>&1 && echo "removed $old"
      done
    }
done
docker image prune -f --filter "label=sparkctl.recipe=$recipe" --filter "label=sparkctl.content-hash" >/dev/null
exit 0'''

assert LABEL_CONTENT_HASH == "sparkctl.content-hash" and LABEL_RECIPE == "sparkctl.recipe"  # spelt out above


def retain_argv(keep: int, recipe: str, tags: Sequence[str]) -> list[str]:
    return ["sh", "-c", _RETAIN, "sparkctl-retain", str(int(keep)), recipe, *tags]


def retain(node: Node, keep: int, recipe: str, tags: Sequence[str]) -> list[str]:
    """Tag, trim and prune on one node; returns the hash tags it removed."""
    r = node.run(retain_argv(keep, recipe, tags), timeout=300)
    if not r.ok:
        first = next((ln for ln in r.stderr.splitlines() if ln.strip()), f"exit status {r.exit_code}")
        raise NodeError(node.name, "docker", f"cannot tag the chain by content hash: {first[:300]}")
    return [ln.removeprefix("removed ") for ln in r.stdout.splitlines() if ln.startswith("removed ")]
