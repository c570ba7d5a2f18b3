"""`sparkctl export systemd`'s flow: install the supervisor's unit on a node (`systemd_unit` renders it
and holds the install script; this runs the script there and names what its exit status means)."""

from __future__ import annotations

from typing import Any

from ..cluster import Cluster
from ..errors import CheckFailed
from ..spec.systemd_unit import UnitInstall, install_argv, install_recipe_argv
from .locking import lock_cluster


def install_unit(ssh_config: Any, target: str, cluster_name: str, unit: UnitInstall) -> None:
    """Check that `target` can run the unit's program, write the files the unit names (the recipe's copy,
    the env file's), then the unit, enable and start it, under the cluster's lock on `target`; CheckFailed
    with the fix when it cannot. A unit already installed keeps running its own copies until the new unit
    replaces it."""
    name, copy = unit.name, unit.recipe
    env_copy = unit.files[1][0] if len(unit.files) > 1 else ""
    with Cluster([target], ssh_config) as cluster, lock_cluster(cluster, [target], cluster_name, "export systemd"):
        node = cluster.node(target)
        for i, (path, content) in enumerate(unit.files):
            r = node.run(install_recipe_argv(path, unit.program if i == 0 else ""), stdin=content, timeout=60)
            if not r.ok:
                break
        if r.ok:
            r = node.run(install_argv(cluster_name, copy, env_copy), stdin=unit.text.encode(), timeout=60)
    hints = {4: f"installing a unit needs root on {target}: log in as root, or install the `--print` output",
             5: f"{target} has no systemctl: the unit is written to /etc/systemd/system/{name} but not enabled",
             6: f"{target} has no {unit.program} that systemd can run (an absolute path, or a name in "
                "/usr/local/bin, /usr/bin and the like): nothing was written",
             3: f"cannot write /etc/systemd/system/{name} or {copy} on {target}"}
    if r.exit_code == 6:
        raise CheckFailed(hints[6], fix=f"install sparkctl on {target} where systemd finds it, or pass "
                          f"`--sparkctl PATH` (its absolute path on {target})")
    if r.exit_code in hints:
        raise CheckFailed(hints[r.exit_code], fix="`sparkctl export systemd --print` shows the unit")
    if not r.ok:
        raise CheckFailed(f"systemctl on {target} failed: {(r.stderr.strip() or r.stdout.strip())[:300]}",
                          fix=f"`systemctl status {name}` on {target}")
