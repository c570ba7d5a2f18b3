"""The node-side probe scripts' rules (what its mutation run, bench/mutation.py, showed untested).

model_node.py reads /proc/self/mountinfo, text it does not control: a line cut short is skipped, never
a crash that loses the whole description. hf_pull.py checks what the download left: a file missing
after it is an error naming the file, in the one JSON document the head reads."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from sparkctl.lab import ckptgen
from sparkctl.lab.hfhub import StandinHub
from sparkctl.probes.model_node import mount_of

ROOT = "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"


@pytest.mark.parametrize("cut", [
    "36 22 259:3 / /models rw,relatime shared:2 - xfs\n",  # no source after the type
    "36 22 259:3 / - xfs /dev/nvme1n1 rw\n",  # fewer than five fields before the separator
])
def test_a_mountinfo_line_cut_short_is_skipped_not_a_crash(cut: str) -> None:
    """The cut line would be the longer match for /models/x; it is skipped, so / (the last whole
    line that contains the path) is the answer."""
    assert mount_of("/models/x", ROOT + cut) == {"mountpoint": "/", "fstype": "ext4", "source": "/dev/nvme0n1p2"}
    whole = "36 22 259:3 / /models rw,relatime shared:2 - xfs /dev/nvme1n1 rw\n"
    assert mount_of("/models/x", ROOT + cut + whole)["source"] == "/dev/nvme1n1"


def test_a_file_missing_after_the_download_is_an_error_naming_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The client returns without error but wrote nothing: the script says `incomplete`, how many
    files are missing and the first five by name, and writes no marker (the next pull starts over)."""
    hf = pytest.importorskip("huggingface_hub")
    import sparkctl.probes.hf_pull as hp

    pack = ckptgen.make_checkpoint(tmp_path / "pack", "tiny")
    names = sorted(p.relative_to(pack).as_posix() for p in pack.rglob("*") if p.is_file())
    hub = StandinHub(tmp_path / "hub")
    rev = hub.publish("lab/tiny", pack)
    monkeypatch.setattr(hf, "snapshot_download", lambda *a, **kw: None)  # "done", nothing written
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    dest = tmp_path / "dest"
    with hub.serve() as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", url)
        rc = hp.main(["lab/tiny", rev, str(dest)])
    doc = json.loads(out.getvalue().splitlines()[-1])
    assert rc == 1 and doc["status"] == "error" and doc["code"] == "incomplete", doc
    assert doc["message"] == f"{len(names)} file(s) missing after the download: " + ", ".join(names[:5])
    assert not (dest / hp.MARKER).exists()
