"""The console script's start: what it imports before the command runs."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_cli_process_never_imports_invoke_and_paramiko_still_loads() -> None:
    """paramiko.config imports invoke (only for its own `Match exec`, which sparkctl leaves to `ssh -G`):
    the entry point marks it absent, so a command's start does not pay for it."""
    code = ("import sys; from sparkctl import entry; entry.skip_invoke(); import paramiko; "
            "from paramiko import config; print(sys.modules.get('invoke'), config.invoke)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None"]
