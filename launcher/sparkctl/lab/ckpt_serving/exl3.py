"""mul1 layer: EXL3 overlay, mcg/mul1 markers and per-layer codebook detection (lab test payload)."""

CODEBOOKS = ("mcg", "mul1")
ALLOWED_BITS = (3, 4, 5, 6)
SCALAR_MARKERS = False  # serving/patch_keys3.py turns this on: markers may be 0-d scalars


def codebook_of(tensor_names):
    """The one codebook marker among a linear's tensor names."""
    found = {name.rsplit(".", 1)[-1] for name in tensor_names} & set(CODEBOOKS)
    if len(found) != 1:
        raise ValueError(f"expected one codebook marker, found {sorted(found)}")
    return found.pop()
