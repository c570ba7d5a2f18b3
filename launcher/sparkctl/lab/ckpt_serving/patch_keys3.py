"""keys3 layer: let the installed EXL3 overlay take 0-d scalar codebook markers (lab test payload).

Usage: patch_keys3.py PATH/TO/exl3.py. Idempotent; fails when the overlay is not the expected one.
"""

import pathlib
import sys

overlay = pathlib.Path(sys.argv[1])
text = overlay.read_text()
if "SCALAR_MARKERS = True" in text:
    print("keys3: already patched", overlay)
    sys.exit(0)
if "SCALAR_MARKERS = False" not in text:
    sys.exit(f"{overlay}: not the overlay this patch is for (no SCALAR_MARKERS line)")
overlay.write_text(text.replace("SCALAR_MARKERS = False", "SCALAR_MARKERS = True", 1))
print("keys3: patched", overlay)
