"""What the megatron backend needs to know of an HF model, from its `config.json` (JSON only:
the launcher checks a run's model and parallel settings with it before anything starts).

`ModelSpec.of(config)` reads the shape, RoPE theta, RMSNorm eps, q/k/v biases and tied
embeddings of a Qwen2 / Qwen2.5 or Llama(-3) config, and refuses, naming the field, what the
backend's model and weight mapping do not carry: another architecture, RoPE scaling,
sliding-window attention, Llama's optional biases.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


class MappingError(ValueError):
    """An HF model the megatron backend cannot carry, phrased for the user."""


@dataclass(frozen=True)
class ModelSpec:
    """The facts of an HF config.json that the Megatron model and the mapping depend on."""
    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tied: bool

    @staticmethod
    def of(config: dict[str, Any]) -> "ModelSpec":
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise MappingError(f"config.json architectures {archs}: the megatron backend supports {list(ARCHITECTURES)}")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise MappingError(f"config.json rope_parameters {rope or config.get('rope_scaling')}: the megatron "
                               f"backend supports plain RoPE only (rope_type default, no rope_scaling)")
        if config.get("use_sliding_window"):
            raise MappingError("config.json use_sliding_window: true: the megatron backend has full attention only")
        if arch == "LlamaForCausalLM" and (config.get("attention_bias") or config.get("mlp_bias")):
            raise MappingError("config.json attention_bias/mlp_bias: the megatron backend supports Llama without biases")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelSpec(arch, hidden, int(config["intermediate_size"]), int(config["num_hidden_layers"]), heads,
                         int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads),
                         int(config["vocab_size"]), int(config.get("max_position_embeddings", 2048)),
                         float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                         float(config.get("rms_norm_eps", 1e-6)), arch == "Qwen2ForCausalLM",
                         bool(config.get("tie_word_embeddings", False)))

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp
