"""Hugging Face ⇄ Megatron-core weights for the Qwen2 / Qwen2.5 / Llama(-3) architecture, one table.

`table(spec)` lists every Megatron parameter (names of megatron-core's local layer spec) with the
HF tensors it is made of and how it is cut across tensor-parallel ranks:

- `replicated`: the same on every rank (RMSNorm weights);
- `row`: split along the input dimension (`linear_proj`, `linear_fc2`);
- `vocab`: split along the vocabulary, padded with zero rows to a multiple of `tp` (the
  backend masks the padded logits out, `scoring.py`; `to_hf` drops the rows again);
- `qkv`: q, k and v fused per query group, [q heads of group g, k_g, v_g] for each group g
  in turn (Megatron's layout), split by whole groups, so `tp` must divide the kv heads;
- `fc1`: gate and up projections stacked, each split on its own: rank r holds
  [gate_r; up_r], not a contiguous slice of [gate; up].

`to_megatron(hf, spec, tp, rank)` is rank `rank`'s shard; `to_hf(shards, spec)` puts the
shards of all `tp` ranks (in rank order) back into the HF layout. Both only reshape, slice
and concatenate, so HF → Megatron → HF is bit-exact. The output layer exists only when the
embeddings are untied (Megatron shares the embedding's weight otherwise).

Pipeline stages cut a shard again: `to_stage(shard, spec, pp, stage)` keeps stage `stage`'s
layers (renumbered from 0, as Megatron numbers a stage's layers), the embedding on the first
stage and the final norm and output layer on the last; `from_stages` is its inverse. With
tied embeddings and pp > 1 the last stage holds its own copy of the embedding as its output
layer (as Megatron does: the two stages are different processes), kept equal by summing
the two copies' gradients (`backend.py`); `from_stages` drops the copy.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

import torch

from astraflow.trainer.megatron.spec import MappingError, ModelSpec


@dataclass(frozen=True)
class Entry:
    megatron: str
    kind: str  # replicated | row | vocab | qkv | fc1
    hf: tuple[str, ...]


_LAYER = (
    ("input_layernorm.weight", "replicated", ("input_layernorm.weight",)),
    ("self_attention.linear_qkv.weight", "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    ("self_attention.linear_qkv.bias", "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias")),
    ("self_attention.linear_proj.weight", "row", ("self_attn.o_proj.weight",)),
    ("pre_mlp_layernorm.weight", "replicated", ("post_attention_layernorm.weight",)),
    ("mlp.linear_fc1.weight", "fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.linear_fc2.weight", "row", ("mlp.down_proj.weight",)),
)


def table(spec: ModelSpec) -> list[Entry]:
    """Every Megatron parameter of `spec`'s model and its HF tensors."""
    out = [Entry("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",))]
    for i in range(spec.layers):
        out += [Entry(f"decoder.layers.{i}.{m}", kind, tuple(f"model.layers.{i}.{h}" for h in hf))
                for m, kind, hf in _LAYER if spec.qkv_bias or not m.endswith(".bias")]
    out.append(Entry("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",)))
    if not spec.tied:
        out.append(Entry("output_layer.weight", "vocab", ("lm_head.weight",)))
    return out


def _groups(spec: ModelSpec) -> tuple[int, list[int]]:
    """Query groups and the rows of q, k and v in each group."""
    return spec.kv_heads, [spec.heads // spec.kv_heads * spec.head_dim, spec.head_dim, spec.head_dim]


def to_megatron(hf: dict[str, torch.Tensor], spec: ModelSpec, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank `rank`'s parameters (of `tp`), from a full HF state dict."""
    if spec.heads % tp or spec.kv_heads % tp:
        raise MappingError(f"tp={tp} does not divide the {spec.kv_heads} kv heads and {spec.heads} attention heads")
    out = {}
    for e in table(spec):
        parts = [hf[name] for name in e.hf]
        if e.kind == "replicated":
            out[e.megatron] = parts[0].clone()
        elif e.kind == "row":
            out[e.megatron] = parts[0].chunk(tp, dim=1)[rank].clone()
        elif e.kind == "vocab":
            w = parts[0]
            padded = torch.cat([w, w.new_zeros(spec.padded_vocab(tp) - w.shape[0], *w.shape[1:])])
            out[e.megatron] = padded.chunk(tp)[rank].clone()
        elif e.kind == "fc1":
            out[e.megatron] = torch.cat([p.chunk(tp)[rank] for p in parts])
        else:  # qkv
            groups, _ = _groups(spec)
            fused = torch.cat([p.reshape(groups, -1, *p.shape[1:]) for p in parts], dim=1)
            out[e.megatron] = fused.chunk(tp)[rank].reshape(-1, *parts[0].shape[1:]).clone()
    return out


def to_hf(shards: list[dict[str, torch.Tensor]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The full HF state dict from every tensor-parallel rank's parameters, in rank order."""
    out = {}
    for e in table(spec):
        parts = [s[e.megatron] for s in shards]
        if e.kind == "replicated":
            out[e.hf[0]] = parts[0].clone()
        elif e.kind == "row":
            out[e.hf[0]] = torch.cat(parts, dim=1)
        elif e.kind == "vocab":
            out[e.hf[0]] = torch.cat(parts)[: spec.vocab].clone()
        elif e.kind == "fc1":
            halves = [p.chunk(2) for p in parts]
            out[e.hf[0]] = torch.cat([h[0] for h in halves])
            out[e.hf[1]] = torch.cat([h[1] for h in halves])
        else:  # qkv
            groups, rows = _groups(spec)
            fused = torch.cat(parts).reshape(groups, sum(rows), *parts[0].shape[1:])
            for name, piece in zip(e.hf, fused.split(rows, dim=1)):
                out[name] = piece.reshape(-1, *parts[0].shape[1:]).clone()
    if spec.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


T = TypeVar("T")
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


def _renumber(name: str, offset: int) -> str:
    return _LAYER_NAME.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def to_stage(shard: dict[str, T], spec: ModelSpec, pp: int, stage: int) -> dict[str, T]:
    """Pipeline stage `stage`'s (of `pp`) part of a tensor-parallel shard (tensors, or anything
    else by parameter name: `stage_kinds`), its layers numbered from 0."""
    per, first, last = spec.layers // pp, stage == 0, stage == pp - 1
    out = {}
    for name, tensor in shard.items():
        layer = _LAYER_NAME.match(name)
        if layer:
            if stage * per <= int(layer.group(1)) < (stage + 1) * per:
                out[_renumber(name, -stage * per)] = tensor
        elif (name == EMBEDDING and first) or (name in (FINAL_NORM, OUTPUT) and last):
            out[name] = tensor
    if spec.tied and pp > 1 and last:
        out[OUTPUT] = shard[EMBEDDING]
    return out


def from_stages(stages: list[dict[str, torch.Tensor]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A tensor-parallel shard from its pipeline stages' parts (in stage order)."""
    per = spec.layers // len(stages)
    out = {}
    for stage, part in enumerate(stages):
        for name, tensor in part.items():
            if not (name == OUTPUT and spec.tied):  # the last stage's copy of the tied embedding
                out[_renumber(name, stage * per)] = tensor
    return out


def stage_kinds(spec: ModelSpec, pp: int, stage: int) -> dict[str, str]:
    """How each parameter of a pipeline stage is cut across tensor-parallel ranks, by its local name."""
    return to_stage({e.megatron: e.kind for e in table(spec)}, spec, pp, stage)
