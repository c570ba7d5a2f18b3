"""v145 layer: turn exllamav3's x86 AVX all-reduce path off for Grace (aarch64) (lab test payload).

Usage: patch_aarch64.py EXLLAMAV3_SOURCE_DIR. Idempotent; fails when the line to patch is not there.
"""

import pathlib
import sys

init = pathlib.Path(sys.argv[1]) / "__init__.py"
text = init.read_text()
if "USE_AVX = False" not in text:
    if "USE_AVX = True" not in text:
        sys.exit(f"{init}: no USE_AVX line to patch")
    init.write_text(text.replace("USE_AVX = True", "USE_AVX = False", 1))
print("aarch64: patched", init)
