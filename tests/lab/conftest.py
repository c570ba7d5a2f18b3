"""The `lab` fixture: a running lab cluster (root only), shared by every lab test in the session.

Use it like this (see tests.kit.lab for the full API):

    @pytest.mark.lab
    def test_something(lab: Lab) -> None:
        assert lab.ssh("spark1", "true").returncode == 0          # real SSH, host keys checked
        lab.docker("spark2", "ps")                               # spark2's own engine
        subprocess.run(["sparkctl", "--env-file", str(lab.env_file), "check"], env=lab.env())
        lab.host("spark3").fabric_if == "enp1s0f1np1"            # truths to compare discoveries with

If a healthy lab with at least 4 hosts is already up (as `.ci/run` leaves it), it is reused and left
up (a lab made `--fresh`, whose fabric `sparkctl setup` addressed, gets the lab's own fabric back first); otherwise the fixture runs `lab up --nodes 4` and runs `lab down` at the end of the session
(set SPARKCTL_LAB_KEEP=1 to keep it). Tests that change a host (its model folder, containers) must
undo that in a `finally:`; Lab.run_rank / Lab.rm / Lab.wait_exit / Lab.rank_env help with containers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.kit.lab import Lab
from tests.lab.realengine import real  # noqa: F401 - the real-engine fixture, for every test_realengine*_lab.py


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    if os.geteuid() != 0:
        pytest.skip("lab tests need root (network namespaces, sshd and dockerd per host); run .ci/run as root")
    from sparkctl.lab import manage

    _, hosts, state = manage.status(deep=False)
    started = False
    if len(hosts) < 4 or not all(h.ok for h in hosts):
        manage.up(nodes=max(4, len(hosts)))
        started = True
    elif state.get("fabric") == "setup":  # a lab made --fresh (the demo's): the tests need the lab's own fabric
        manage.up(nodes=len(hosts))
    try:
        yield Lab.load()
    finally:
        if started and os.environ.get("SPARKCTL_LAB_KEEP") != "1":
            manage.down()



@pytest.fixture(scope="session")
def chain(lab: Lab) -> Lab:
    """The lab recipe's image chain built on spark1..4 (a no-op when it is already up to date), so
    that the recipe's IMAGE (the chain's top) is there for `up`."""
    env = {**lab.env(), "NODES": "spark1 spark2 spark3 spark4"}
    r = subprocess.run([sys.executable, "-m", "sparkctl", "build"], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"sparkctl build failed:\n{r.stdout}\n{r.stderr}"
    return lab
