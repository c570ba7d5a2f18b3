"""keys layer: load-time abliteration hook (lab test payload). Idle unless ABLIT is set and not 0."""

import os

ALPHA = 3.0


def enabled():
    return os.environ.get("ABLIT", "0") not in ("", "0")
