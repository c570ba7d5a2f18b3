"""`sparkctl export systemd`'s flow: install the supervisor's unit on a node (`systemd_unit` renders it
and holds the install script; this runs the script there and names what its exit status means)."""

from __future__ import annotations

from typing import Any

from ..cluster import Cluster
from ..errors import CheckFailed
from ..systemd_unit import install_argv
from .locking import lock_cluster


def install_unit(ssh_config: Any, target: str, cluster_name: str, name: str, text: str) -> None:
    """Write unit `name` (`text`) on `target`, enable and start it; CheckFailed with the fix when it cannot."""
    with Cluster([target], ssh_config) as cluster, lock_cluster(cluster, [target], cluster_name, "export systemd"):
        r = cluster.node(target).run(install_argv(cluster_name), stdin=text.encode(), timeout=60)
    hints = {4: f"installing a unit needs root on {target}: log in as root, or install the `--print` output",
             5: f"{target} has no systemctl: the unit is written to /etc/systemd/system/{name} but not enabled",
             3: f"cannot write /etc/systemd/system/{name} on {target}"}
    if r.exit_code in hints:
        raise CheckFailed(hints[r.exit_code], fix="`sparkctl export systemd --print` shows the unit")
    if not r.ok:
        raise CheckFailed(f"systemctl on {target} failed: {(r.stderr.strip() or r.stdout.strip())[:300]}",
                          fix=f"`systemctl status {name}` on {target}")
