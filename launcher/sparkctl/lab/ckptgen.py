"""Test checkpoints: GLM-5.3 EXL3 packs with real headers, generated in seconds.

    make_checkpoint(dest, "tiny")     6 layers, real bytes, < 2 MB: the lab and the unit tests
    make_checkpoint(dest, "3.00bpw")  the 3.00 bpw card's pack: 41 shards, 78 layers + MTP layer 78, 3-bit experts
    make_checkpoint(dest, "2.75bpw")  the mixed-K pack: 81 shards, 2/3/4-bit experts, 5-bit attention,
                                      8-bit MTP experts, optional 6-bit head file
    make_checkpoint(dest, "4bit")     like 3.00bpw with 4-bit experts: too big for four 128 GB nodes

Full-size packs are sparse by default: the headers are real and the data region is a hole
(truncate), so 308 GB costs a few MB of disk. Shapes follow GLM-5's config (docs/sources.md, "The checkpoints") honestly, with
no padding tensor: 3.00bpw comes to 330.9e9 bytes (308.2 GiB, the card's "308 GB") = 77.1 GiB per
rank at TP4; 4bit to 421.5e9 bytes = 98.1 GiB per rank (docs/sources.md says ~101; no padding was added
to reach it, the planner refuses it either way); 2.75bpw to 276.6e9 bytes (257.6 GiB, the card's
"~258 GB").

An EXL3 linear K (in x out, b bits) is stored as K.trellis int16 [in/16, out/16, 16*b], K.suh fp16
[in], K.svh fp16 [out] and one 0-d codebook marker K.mcg or K.mul1 (exllamav3's ABI).

The fault injectors at the bottom edit a generated pack in place, for the verify-model tests.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.safetensors import encode_header, nbytes, read_header

INDEX = "model.safetensors.index.json"
Spec = tuple[str, str, tuple[int, ...]]  # (name, dtype, shape)


@dataclass(frozen=True)
class Dims:
    """The config.json fields that decide tensor shapes (GLM-5 / DeepSeek-V3.2 style MLA + MoE)."""

    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    intermediate: int
    moe_intermediate: int
    experts: int
    vocab: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    layers: int
    first_dense: int
    experts_per_tok: int


FULL = Dims(hidden=6144, heads=64, q_lora=2048, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256,
            intermediate=12288, moe_intermediate=2048, experts=256, vocab=154880, index_heads=32,
            index_head_dim=128, index_topk=2048, layers=78, first_dense=3, experts_per_tok=8)
# Every dimension an EXL3 matrix uses is a multiple of 16, as the trellis layout requires.
TINY = Dims(hidden=64, heads=2, q_lora=32, kv_lora=32, qk_nope=16, qk_rope=16, v_head=16,
            intermediate=96, moe_intermediate=32, experts=8, vocab=256, index_heads=2,
            index_head_dim=16, index_topk=64, layers=6, first_dense=3, experts_per_tok=2)


@dataclass(frozen=True)
class Pack:
    dims: Dims
    shards: int
    expert_bits: Callable[[int, int], int]  # (layer, expert) -> bits of routed experts
    mtp_expert_bits: int | None = None      # None: the MTP block's experts stay bf16
    other_bits: int | None = None           # attention / shared / dense as EXL3 at this width
    kv_a_width: int | None = None           # stored width of kv_a_proj_with_mqa (2.75 pads to 640)
    all_mul1: bool = False
    head6: bool = False                     # write lm_head-6bit/lm_head-6bit.safetensors
    quant: tuple[tuple[str, object], ...] = ()


def _mixed_bits(layer: int, expert: int) -> int:
    # 3 of 8 experts at 2 bits, 4 at 3 bits, 1 at 4 bits: mean exactly 2.75.
    return (2, 3, 2, 3, 4, 3, 2, 3)[(layer * 3 + expert) % 8]


PACKS: dict[str, Pack] = {
    "tiny": Pack(TINY, 3, lambda layer, e: 3, quant=(("bits", 3), ("scope", "glm53_routed_experts_only"))),
    "3.00bpw": Pack(FULL, 41, lambda layer, e: 3, quant=(("bits", 3), ("scope", "glm53_routed_experts_only"))),
    "4bit": Pack(FULL, 54, lambda layer, e: 4, quant=(("bits", 4), ("scope", "glm53_routed_experts_only"))),
    "2.75bpw": Pack(FULL, 81, _mixed_bits, mtp_expert_bits=8, other_bits=5, kv_a_width=640, all_mul1=True,
                    head6=True, quant=(("bits", 2.75), ("scope", "glm53_mixed_k"),
                                       ("expert_bits", [2, 3, 4]), ("mtp_expert_bits", 8), ("other_bits", 5))),
}


def exl3(module: str, n_in: int, n_out: int, bits: int, codebook: str) -> list[Spec]:
    """The four tensors of one EXL3 linear."""
    return [(f"{module}.trellis", "I16", (n_in // 16, n_out // 16, 16 * bits)),
            (f"{module}.suh", "F16", (n_in,)),
            (f"{module}.svh", "F16", (n_out,)),
            (f"{module}.{codebook}", "I32", ())]


def _linear(module: str, n_in: int, n_out: int, bits: int | None, codebook: str) -> list[Spec]:
    if bits is None:
        return [(f"{module}.weight", "BF16", (n_out, n_in))]
    return exl3(module, n_in, n_out, bits, codebook)


def tensor_specs(pack: str, codebook_switch_layer: int | None = 4) -> Iterator[Spec]:
    """Every tensor of `pack` in checkpoint order (embeddings, layers 0..MTP, final norm, head)."""
    p = PACKS[pack]
    d = p.dims
    H = d.hidden
    yield ("model.embed_tokens.weight", "BF16", (d.vocab, H))
    for L in range(d.layers + 1):  # layer d.layers is the MTP block
        pre = f"model.layers.{L}"
        mtp = L == d.layers

        def cb(layer: int = L) -> str:
            if p.all_mul1:
                return "mul1"
            return "mul1" if codebook_switch_layer is not None and layer >= codebook_switch_layer else "mcg"

        ob = p.other_bits
        yield (f"{pre}.input_layernorm.weight", "BF16", (H,))
        yield (f"{pre}.post_attention_layernorm.weight", "BF16", (H,))
        a = f"{pre}.self_attn"
        yield from _linear(f"{a}.q_a_proj", H, d.q_lora, ob, "mul1")
        yield (f"{a}.q_a_layernorm.weight", "BF16", (d.q_lora,))
        yield from _linear(f"{a}.q_b_proj", d.q_lora, d.heads * (d.qk_nope + d.qk_rope), ob, "mul1")
        yield from _linear(f"{a}.kv_a_proj_with_mqa", H, p.kv_a_width or d.kv_lora + d.qk_rope, ob, "mul1")
        yield (f"{a}.kv_a_layernorm.weight", "BF16", (d.kv_lora,))
        yield from _linear(f"{a}.kv_b_proj", d.kv_lora, d.heads * (d.qk_nope + d.v_head), None, "mul1")
        yield from _linear(f"{a}.o_proj", d.heads * d.v_head, H, ob, "mul1")
        yield from _linear(f"{a}.indexer.wq_b", d.q_lora, d.index_heads * d.index_head_dim, ob, "mul1")
        yield from _linear(f"{a}.indexer.wk", H, d.index_head_dim, None, "mul1")
        yield (f"{a}.indexer.k_norm.weight", "BF16", (d.index_head_dim,))
        yield (f"{a}.indexer.k_norm.bias", "BF16", (d.index_head_dim,))
        yield from _linear(f"{a}.indexer.weights_proj", H, d.index_heads, None, "mul1")
        m = f"{pre}.mlp"
        if L < d.first_dense:
            yield from _linear(f"{m}.gate_proj", H, d.intermediate, ob, "mul1")
            yield from _linear(f"{m}.up_proj", H, d.intermediate, ob, "mul1")
            yield from _linear(f"{m}.down_proj", d.intermediate, H, ob, "mul1")
        else:
            yield (f"{m}.gate.weight", "BF16", (d.experts, H))
            yield (f"{m}.gate.e_score_correction_bias", "F32", (d.experts,))
            yield from _linear(f"{m}.shared_experts.gate_proj", H, d.moe_intermediate, ob, "mul1")
            yield from _linear(f"{m}.shared_experts.up_proj", H, d.moe_intermediate, ob, "mul1")
            yield from _linear(f"{m}.shared_experts.down_proj", d.moe_intermediate, H, ob, "mul1")
            for e in range(d.experts):
                bits = p.mtp_expert_bits if mtp else p.expert_bits(L, e)
                codebook = "mul1" if mtp else cb()
                ex = f"{m}.experts.{e}"
                yield from _linear(f"{ex}.gate_proj", H, d.moe_intermediate, bits, codebook)
                yield from _linear(f"{ex}.up_proj", H, d.moe_intermediate, bits, codebook)
                yield from _linear(f"{ex}.down_proj", d.moe_intermediate, H, bits, codebook)
        if mtp:
            yield (f"{pre}.enorm.weight", "BF16", (H,))
            yield (f"{pre}.hnorm.weight", "BF16", (H,))
            yield (f"{pre}.eh_proj.weight", "BF16", (H, 2 * H))
            yield (f"{pre}.shared_head.norm.weight", "BF16", (H,))
    yield ("model.norm.weight", "BF16", (H,))
    yield ("lm_head.weight", "BF16", (d.vocab, H))


def config_json(pack: str) -> dict[str, object]:
    """config.json with GLM-5's fields, consistent with the tensors (a planner computes from it)."""
    d = PACKS[pack].dims
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "torch_dtype": "bfloat16",
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_intermediate,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.heads,
        "q_lora_rank": d.q_lora,
        "kv_lora_rank": d.kv_lora,
        "qk_nope_head_dim": d.qk_nope,
        "qk_rope_head_dim": d.qk_rope,
        "v_head_dim": d.v_head,
        "index_n_heads": d.index_heads,
        "index_head_dim": d.index_head_dim,
        "index_topk": d.index_topk,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.experts_per_tok,
        "first_k_dense_replace": d.first_dense,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 1048576 if d is FULL else 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": [1, 2],
    }


# The checkpoint's own image chain (serving/Dockerfile.* and what they copy): see ckpt_serving/README.md.
SERVING_SOURCE = Path(__file__).resolve().parent / "ckpt_serving"


def serving_files() -> dict[str, bytes]:
    """Every file of the lab checkpoint's serving/ folder (relative path -> bytes)."""
    return {p.relative_to(SERVING_SOURCE).as_posix(): p.read_bytes() for p in sorted(SERVING_SOURCE.rglob("*"))
            if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts}


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _write_shard(path: Path, specs: list[Spec], *, sparse: bool, seed: int,
                 keep: dict[str, bytes] | None = None) -> int:
    """Write one safetensors file; returns its data bytes. Real data is seeded pseudo-random."""
    raw, layout = encode_header({name: (dtype, shape) for name, dtype, shape in specs}, {"format": "pt"})
    data_len = max((t.end for t in layout.values()), default=0)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        if sparse:
            f.truncate(8 + len(raw) + data_len)  # the data region is a hole: no disk, reads as zeros
        else:
            rng = random.Random(seed)
            for name, t in layout.items():
                old = (keep or {}).get(name)
                f.write(old if old is not None and len(old) == t.end - t.begin else rng.randbytes(t.end - t.begin))
    os.replace(tmp, path)
    return data_len


def make_checkpoint(dest: Path, pack: str = "tiny", *, sparse: bool | None = None,
                    codebook_switch_layer: int | None = 4, serving: bool = True) -> Path:
    """Write a test checkpoint of `pack` into `dest` (created; existing pack files are overwritten).

    sparse: None = sparse for the full-size packs, real bytes for "tiny".
    codebook_switch_layer: routed experts of layers >= this use mul1, earlier ones mcg (the model card's
    resume accident at 4); None = mcg everywhere. The 2.75bpw pack is mul1 throughout.
    """
    if pack not in PACKS:
        raise ValueError(f"unknown pack {pack!r} (one of {', '.join(PACKS)})")
    p = PACKS[pack]
    sparse = pack != "tiny" if sparse is None else sparse
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    specs = list(tensor_specs(pack, codebook_switch_layer))
    sizes = [nbytes(dt, shape) for _, dt, shape in specs]
    total = sum(sizes)
    # Cut into p.shards pieces of about equal bytes, in checkpoint order, as HF's sharding does.
    groups: list[list[Spec]] = [[] for _ in range(p.shards)]
    pos = 0
    for spec, size in zip(specs, sizes, strict=True):
        groups[min(p.shards - 1, pos * p.shards // total)].append(spec)
        pos += size
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, 1):
        name = _shard_name(i, p.shards)
        _write_shard(dest / name, group, sparse=sparse, seed=i)
        for tname, _, _ in group:
            weight_map[tname] = name
    _write_index(dest, weight_map, total)
    (dest / "config.json").write_text(json.dumps(config_json(pack), indent=2) + "\n")
    quant = {"quant_method": "exl3", **dict(p.quant)}
    (dest / "quantization_config.json").write_text(json.dumps(quant, indent=2) + "\n")
    if p.head6:
        d = p.dims
        (dest / "lm_head-6bit").mkdir(exist_ok=True)
        _write_shard(dest / "lm_head-6bit" / "lm_head-6bit.safetensors",
                     exl3("lm_head", d.hidden, d.vocab, 6, "mul1"), sparse=sparse, seed=0)
    if serving:
        for fname, data in serving_files().items():
            (dest / "serving" / fname).parent.mkdir(parents=True, exist_ok=True)
            (dest / "serving" / fname).write_bytes(data)
            if fname.endswith(".sh"):
                (dest / "serving" / fname).chmod(0o755)
    return dest


def _write_index(dest: Path, weight_map: dict[str, str], total: int) -> None:
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / INDEX).write_text(json.dumps(doc, indent=2) + "\n")


# ---------------------------------------------------------------- fault injectors (for tests)


def shards(dest: Path) -> list[Path]:
    """The pack's top-level shards, in order."""
    return sorted(Path(dest).glob("model-*.safetensors"))


def remove_shard(dest: Path, n: int = 1) -> Path:
    """Delete the n-th shard (1-based); returns its path."""
    path = shards(dest)[n - 1]
    path.unlink()
    return path


def truncate_shard(dest: Path, n: int = 1, nbytes: int = 1) -> Path:
    """Cut `nbytes` off the end of the n-th shard, as an interrupted download leaves it."""
    path = shards(dest)[n - 1]
    os.truncate(path, path.stat().st_size - nbytes)
    return path


def header_past_eof(dest: Path, n: int = 1) -> Path:
    """Make the n-th shard's 8-byte header length point past the end of the file."""
    path = shards(dest)[n - 1]
    with open(path, "r+b") as f:
        f.write((path.stat().st_size + 1000).to_bytes(8, "little"))
    return path


def garbage_header(dest: Path, n: int = 1, size: int = 100_000_000) -> Path:
    """Replace the n-th shard with a `size`-byte header of garbage (sparse: costs ~1 MiB of disk)."""
    path = shards(dest)[n - 1]
    with open(path, "wb") as f:
        f.write(size.to_bytes(8, "little"))
        f.write(random.Random(7).randbytes(1 << 20))
        f.truncate(8 + size + 4096)
    return path


def overlap_offsets(dest: Path, n: int = 1) -> tuple[Path, str]:
    """Make one tensor of the n-th shard start inside its predecessor; returns (shard, tensor)."""
    path = shards(dest)[n - 1]
    with open(path, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        doc = json.loads(f.read(hlen))
    items = sorted(((k, v) for k, v in doc.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
    # Pick a tensor with a non-empty predecessor and move it back by one byte: same length, overlapping.
    movable = [i for i in range(1, len(items))
               if items[i - 1][1]["data_offsets"][1] > items[i - 1][1]["data_offsets"][0]
               and items[i][1]["data_offsets"][1] > items[i][1]["data_offsets"][0]]
    if not movable:
        raise ValueError(f"{path}: no tensor to overlap")
    name, entry = items[movable[0]]
    b, e = entry["data_offsets"]
    entry["data_offsets"] = [b - 1, e - 1]
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) > hlen:
        raise ValueError(f"{path}: rewritten header would not fit")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(raw + b" " * (hlen - len(raw)))  # trailing spaces are allowed after the JSON
    return path, name


def retarget_tensor(dest: Path, name: str | None = None) -> str:
    """Make the index name a tensor's shard wrongly (the tensor is absent from the shard it names)."""
    index_path = Path(dest) / INDEX
    doc = json.loads(index_path.read_text())
    wm: dict[str, str] = doc["weight_map"]
    name = name or next(iter(wm))
    others = sorted(set(wm.values()) - {wm[name]})
    wm[name] = others[0]
    index_path.write_text(json.dumps(doc, indent=2) + "\n")
    return name


Transform = Callable[[str, str, tuple[int, ...]], list[Spec] | None]


def transform_tensors(dest: Path, fn: Transform, prefix: str = "") -> int:
    """Rewrite the pack's shards: fn(name, dtype, shape) returns replacement specs ([] deletes,
    None keeps). Unchanged tensors keep their bytes; the index follows. Returns tensors changed.
    `prefix`: only shards the index says hold a tensor starting with it are opened (speed)."""
    dest = Path(dest)
    index_path = dest / INDEX
    doc = json.loads(index_path.read_text())
    wm: dict[str, str] = doc["weight_map"]
    wanted = {s for n, s in wm.items() if n.startswith(prefix)}
    candidates = [p for p in shards(dest) if p.name in wanted] + sorted(dest.glob("*/*.safetensors"))
    changed = 0
    total = doc["metadata"]["total_size"]
    for path in candidates:
        header = read_header(path)
        specs: list[Spec] = []
        dirty = False
        for tname, t in sorted(header.tensors.items(), key=lambda kv: kv[1].begin):
            out = fn(tname, t.dtype, t.shape)
            if out is None:
                specs.append((tname, t.dtype, t.shape))
                continue
            dirty = True
            changed += 1
            wm.pop(tname, None)
            specs.extend(out)
        if not dirty:
            continue
        sparse = path.stat().st_blocks * 512 < path.stat().st_size // 2
        keep: dict[str, bytes] = {}
        if not sparse:
            with open(path, "rb") as f:
                base = 8 + header.header_len
                for tname, t in header.tensors.items():
                    f.seek(base + t.begin)
                    keep[tname] = f.read(t.end - t.begin)
        new_len = _write_shard(path, specs, sparse=sparse, seed=zlib.crc32(path.name.encode()), keep=keep)
        if path.parent == dest:
            total += new_len - header.data_len
            for tname, _, _ in specs:
                wm[tname] = path.name
    _write_index(dest, wm, total)
    return changed


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def drop_marker(dest: Path, module: str | None = None) -> str:
    """Remove the codebook marker of one EXL3 linear (the first routed expert if not named)."""
    hit: list[str] = []

    def fn(name: str, dtype: str, shape: tuple[int, ...]) -> list[Spec] | None:
        if name.endswith((".mcg", ".mul1")) and ".experts." in name and (module is None and not hit
                                                                          or _module_of(name) == module):
            hit.append(_module_of(name))
            return []
        return None

    transform_tensors(dest, fn)
    return hit[0]


def add_marker(dest: Path, module: str | None = None) -> str:
    """Give one EXL3 linear a second codebook marker (both .mcg and .mul1)."""
    hit: list[str] = []

    def fn(name: str, dtype: str, shape: tuple[int, ...]) -> list[Spec] | None:
        if name.endswith((".mcg", ".mul1")) and ".experts." in name and (module is None and not hit
                                                                          or _module_of(name) == module):
            mod, marker = name.rsplit(".", 1)
            hit.append(mod)
            other = "mul1" if marker == "mcg" else "mcg"
            return [(name, dtype, shape), (f"{mod}.{other}", "I32", ())]
        return None

    transform_tensors(dest, fn)
    return hit[0]


def set_expert_bits(dest: Path, bits: int, layer: int | None = None) -> int:
    """Re-shape the routed experts' trellis to `bits` (of one layer, or all): e.g. 7-bit experts."""

    def fn(name: str, dtype: str, shape: tuple[int, ...]) -> list[Spec] | None:
        if name.endswith(".trellis") and ".mlp.experts." in name and len(shape) == 3:
            if layer is None or name.startswith(f"model.layers.{layer}."):
                return [(name, dtype, (shape[0], shape[1], 16 * bits))]
        return None

    return transform_tensors(dest, fn, "" if layer is None else f"model.layers.{layer}.")


def quantize_mtp(dest: Path, bits: int = 3, codebook: str = "mul1") -> int:
    """Turn the MTP block's bf16 routed experts into EXL3 (what the 3.00 bpw rules forbid)."""
    mtp = json.loads((Path(dest) / "config.json").read_text())["num_hidden_layers"]

    def fn(name: str, dtype: str, shape: tuple[int, ...]) -> list[Spec] | None:
        if name.startswith(f"model.layers.{mtp}.mlp.experts.") and name.endswith(".weight") and len(shape) == 2:
            return exl3(_module_of(name), shape[1], shape[0], bits, codebook)
        return None

    return transform_tensors(dest, fn, f"model.layers.{mtp}.mlp.experts.")


def copy_pack(src: Path, dest: Path) -> Path:
    """Copy a pack keeping sparse files sparse (for tests that damage one of several copies)."""
    shutil.copytree(src, dest, copy_function=_copy_sparse)
    return dest


def _copy_sparse(src: str, dst: str) -> None:
    size = os.path.getsize(src)
    if os.stat(src).st_blocks * 512 >= size // 2:
        shutil.copy2(src, dst)
        return
    with open(src, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        head = f.read(min(hlen, size - 8))
    with open(dst, "wb") as f:
        f.write(hlen.to_bytes(8, "little") + head)
        f.truncate(size)
    shutil.copystat(src, dst)


# ---------------------------------------------------------------- model pull/sync (new revisions, bulk)


def new_revision_of_shard(dest: Path, n: int = 1, seed: int = 1000) -> Path:
    """Rewrite the data of the n-th top-level shard (1-based) with other bytes, keeping its header and
    size: what a new Hub revision that re-quantized one shard looks like. Written aside, then renamed."""
    path = sorted(Path(dest).glob("*.safetensors"))[n - 1]
    hlen = read_header_len(path)
    size = path.stat().st_size
    rng = random.Random(seed)
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as f:
        f.write(src.read(8 + hlen))
        left = size - 8 - hlen
        while left > 0:
            chunk = min(left, 8 << 20)
            f.write(rng.randbytes(chunk))
            left -= chunk
    os.replace(tmp, path)
    return path


def read_header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def make_bulk(dest: Path, shards: int = 41, shard_bytes: int = 50_000_000, seed: int = 7) -> Path:
    """A checkpoint-shaped folder of `shards` real-byte safetensors files (one uint8 tensor each, about
    `shard_bytes`), an index and a config: for transfer benchmarks, where the bytes must be real
    (a sparse pack would measure reading holes). Not a model any layout rule accepts."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i in range(1, shards + 1):
        name = _shard_name(i, shards)
        tname = f"bulk.{i}.weight"
        raw, _ = encode_header({tname: ("U8", (shard_bytes,))}, {"format": "pt"})
        rng = random.Random(seed * 100_003 + i)
        tmp = dest / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            left = shard_bytes
            while left > 0:
                chunk = min(left, 8 << 20)
                f.write(rng.randbytes(chunk))
                left -= chunk
        os.replace(tmp, dest / name)
        weight_map[tname] = name
    _write_index(dest, weight_map, shards * shard_bytes)
    (dest / "config.json").write_text(json.dumps({"model_type": "bulk", "shards": shards}) + "\n")
    return dest
