"""The pieces of megatron-core's local layer spec (no TransformerEngine, no Apex) that this
backend replaces: causal self-attention through PyTorch's `scaled_dot_product_attention`,
and an RMSNorm that runs under sequence parallelism.

Megatron's own `DotProductAttention` materialises the (sequence × sequence) score matrix of
every head and runs the softmax unfused: at 4k tokens that dominated the megatron backend's
step on a GPU. `SdpaAttention` computes the same function with PyTorch's fused kernels
(flash or memory-efficient attention on a GPU, the math kernel on a CPU): causal, scaled by
1/sqrt(head dim), grouped-query heads shared by their query group, no dropout (the backend
has none). Inputs are Megatron's [sequence, batch, heads, head dim]; the output is
[sequence, batch, heads × head dim] of this tensor-parallel rank's heads. The attention is
causal whatever mask the caller passes; the backend's rows are right-padded, so causality is
all the masking they need (padded positions come after the real ones and are never trained).

Megatron's `WrappedTorchNorm` (its norm without Apex) refuses sequence parallelism because
nothing would sum the norm's gradient over the sequence slices; the backend does
(`backend.finish_gradients`), so `RMSNorm` is torch's, built from Megatron's arguments.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SdpaAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None
                ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaAttention: no attention bias or packed sequences")
        length, batch = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [batch, heads, sequence, head dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(length, batch, -1)


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
