"""`sparkctl export systemd`'s flow: install the supervisor's unit on a node (`systemd_unit` renders it
and holds the install script; this runs the script there and names what its exit status means)."""

from __future__ import annotations

from typing import Any

from ..cluster import Cluster
from ..errors import CheckFailed
from ..spec.systemd_unit import install_argv, install_recipe_argv
from .locking import lock_cluster


def install_unit(ssh_config: Any, target: str, cluster_name: str, name: str, text: str,
                 recipe: tuple[str, bytes]) -> None:
    """Write the recipe's copy (`recipe`: its path there and its bytes), then unit `name` (`text`) on
    `target`, enable and start it, under the cluster's lock on `target`; CheckFailed with the fix when it
    cannot. A unit already installed keeps running its own copy until the new unit replaces it."""
    copy, content = recipe
    with Cluster([target], ssh_config) as cluster, lock_cluster(cluster, [target], cluster_name, "export systemd"):
        node = cluster.node(target)
        r = node.run(install_recipe_argv(copy), stdin=content, timeout=60)
        if r.ok:
            r = node.run(install_argv(cluster_name, copy), stdin=text.encode(), timeout=60)
    hints = {4: f"installing a unit needs root on {target}: log in as root, or install the `--print` output",
             5: f"{target} has no systemctl: the unit is written to /etc/systemd/system/{name} but not enabled",
             3: f"cannot write /etc/systemd/system/{name} or {copy} on {target}"}
    if r.exit_code in hints:
        raise CheckFailed(hints[r.exit_code], fix="`sparkctl export systemd --print` shows the unit")
    if not r.ok:
        raise CheckFailed(f"systemctl on {target} failed: {(r.stderr.strip() or r.stdout.strip())[:300]}",
                          fix=f"`systemctl status {name}` on {target}")
