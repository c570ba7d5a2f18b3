"""Probe scripts: standalone, stdlib-only Python that the cluster layer ships to nodes over SSH
(`python3 - ARGS < probe.py`), because nodes do not have sparkctl installed. Local code imports
the same modules and calls their functions directly. Nothing here may import sparkctl.
"""

from __future__ import annotations

from pathlib import Path


def source(name: str) -> str:
    """The source text of probe `name` (e.g. "ckpt_scan"), to send to a node's python3 stdin."""
    return (Path(__file__).resolve().parent / f"{name}.py").read_text()
