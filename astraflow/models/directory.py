"""Checking a Hugging Face model directory before anything loads it (JSON only: no torch).

`check_model_dir` refuses, in one line naming the directory and what is wrong: a path that
does not exist or is not a directory, a missing or unreadable `config.json`, an architecture
the engines and trainers cannot load (`ARCHITECTURES`), no tokenizer files, no weights. The
launcher calls it before any component starts (exit 2), so a typo in `model.path` is never
mistaken for a model to build, and never surfaces as a worker crash-looping on a load.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# What transformers, vLLM and the trainer all load here (decoder-only, RoPE, RMSNorm, GQA).
ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ModelDirError(ValueError):
    """A model directory that cannot serve, already phrased for the user."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    architecture: str
    vocab_size: int
    max_positions: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool


def check_model_dir(path: str | Path, weights: bool = True) -> ModelInfo:
    """The directory's facts, or ModelDirError. `weights=False` for a directory whose weights
    are written later (a run's own model being prepared)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path}: {'not a directory' if path.exists() else 'does not exist'}")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelDirError(f"model directory {path}: no config.json (not a Hugging Face model directory)") from None
    except (OSError, ValueError) as e:
        raise ModelDirError(f"model directory {path}: config.json is unreadable ({e})") from None
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelDirError(f"model directory {path}: architecture {archs or 'missing'} is not supported; "
                            f"expected one of {list(ARCHITECTURES)}")
    if not any(all((path / f).exists() for f in group) for group in TOKENIZER_FILES):
        raise ModelDirError(f"model directory {path}: no tokenizer (expected one of "
                            f"{[' + '.join(g) for g in TOKENIZER_FILES]})")
    if weights and not any((path / f).exists() for f in WEIGHT_FILES):
        raise ModelDirError(f"model directory {path}: no weights (expected one of {list(WEIGHT_FILES)})")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelInfo(path, arch, int(config["vocab_size"]), int(config.get("max_position_embeddings", 2048)),
                         hidden, int(config["num_hidden_layers"]), heads,
                         int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads),
                         bool(config.get("tie_word_embeddings", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelDirError(f"model directory {path}: config.json lacks or garbles {e}") from None
