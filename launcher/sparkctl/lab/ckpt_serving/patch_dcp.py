"""dcp layer: install the decode-context-parallel patch into site-packages (lab test payload).

Usage: patch_dcp.py SITE_PACKAGES. Idempotent: writes the module and the .pth that loads it.
"""

import os
import sys

site = sys.argv[1]
with open(os.path.join(site, "vllm_dcp_patch.py"), "w") as f:
    f.write('"""DCP patch: the comm backends the patched vLLM accepts."""\nBACKENDS = ("ag_rs", "a2a")\n')
with open(os.path.join(site, "zz_vllm_dcp_patch.pth"), "w") as f:
    f.write("import vllm_dcp_patch\n")
print("dcp: patched", site)
