"""A real, tiny, random-weight Llama (or Qwen3) checkpoint for the real vLLM on CPU, made offline.

Run by the real-engine venv's python (transformers, tokenizers and torch are there; nothing is
downloaded): `python make_model.py DEST [--family llama|qwen3]`. What it writes is a Hugging Face-format
folder that vLLM loads as it loads any model of the family: config.json (2 layers, hidden 256, 4 query heads
and 2 KV heads of 64 -- the CPU attention kernel refuses head_dim 16, docs/sources.md; Qwen3 adds its
per-head q/k RMS norms), model safetensors split into several shards with an index (so a missing shard can
be tested), a byte-level BPE tokenizer trained here on a few sentences, and a chat template.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = [
    "The lab engine answers with these words so that every benchmark sees the same tokens.",
    "A cluster of four nodes serves one model behind one endpoint.",
    "hello world, the quick brown fox jumps over the lazy dog.",
    "sparkctl checks every node, starts every rank, and waits until the head answers.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make(dest: Path, vocab: int = 512, family: str = "llama") -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=fast.bos_token_id,
                 eos_token_id=fast.eos_token_id, tie_word_embeddings=False, torch_dtype="bfloat16")
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.bfloat16)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True, max_shard_size="1MB")
    index = dest / "model.safetensors.index.json"
    if not index.exists():
        raise SystemExit(f"expected several shards and an index in {dest}")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    print(json.dumps({"dest": str(dest), "shards": shards}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--family", choices=("llama", "qwen3"), default="llama")
    args = ap.parse_args()
    make(args.dest, family=args.family)


if __name__ == "__main__":
    main()
