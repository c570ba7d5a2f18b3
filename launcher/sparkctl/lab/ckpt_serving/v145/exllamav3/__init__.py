"""exllamav3 1.4.5 (lab stand-in: the version, the codebooks and the flag patch_aarch64.py flips)."""

__version__ = "1.4.5"
USE_AVX = True  # x86 all-reduce path; patch_aarch64.py turns it off
CODEBOOKS = ("mcg", "mul1")  # 0.0.43's exl3_moe rejected mul1
