"""HF ⇄ Megatron weights as tensors alone (no processes): every tensor-parallel size that
divides the kv heads round-trips bit for bit, a vocabulary that does not divide is padded
and trimmed again, each rank's fused q/k/v holds whole query groups in Megatron's order, and
configs the backend cannot carry are refused naming the field. Pipeline stages hold their
own layers, numbered from 0, and put back together give the shard again; with tied
embeddings the last stage holds a copy of the embedding as its output layer."""
from __future__ import annotations

import pytest
import torch

from astraflow.trainer.megatron.mapping import from_stages, stage_kinds, table, to_hf, to_megatron, to_stage
from astraflow.trainer.megatron.spec import MappingError, ModelSpec


def hf_config(**over) -> dict:
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 48, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 100,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            "tie_word_embeddings": False}
    return {**base, **over}


def random_hf(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Random HF tensors of every name and shape the table needs (seeded)."""
    g = torch.Generator().manual_seed(0)
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    shapes = {"q_proj.weight": (q, spec.hidden), "k_proj.weight": (kv, spec.hidden), "v_proj.weight": (kv, spec.hidden),
              "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (spec.hidden, q),
              "gate_proj.weight": (spec.intermediate, spec.hidden), "up_proj.weight": (spec.intermediate, spec.hidden),
              "down_proj.weight": (spec.hidden, spec.intermediate), "layernorm.weight": (spec.hidden,),
              "norm.weight": (spec.hidden,), "embed_tokens.weight": (spec.vocab, spec.hidden),
              "lm_head.weight": (spec.vocab, spec.hidden)}
    out = {}
    for entry in table(spec):
        for name in entry.hf:
            shape = next(s for suffix, s in shapes.items() if name.endswith(suffix))
            out[name] = torch.randn(shape, generator=g)
    if spec.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 3])
def test_round_trip_is_bit_exact_with_a_padded_vocabulary(tp, tied):
    spec = ModelSpec.of(hf_config(tie_word_embeddings=tied))
    hf = random_hf(spec)
    shards = [to_megatron(hf, spec, tp, r) for r in range(tp)]
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == spec.padded_vocab(tp) // tp
    if tp == 3:  # 100 rows padded to 102: the last rank's last two rows are zeros
        assert torch.equal(shards[-1]["embedding.word_embeddings.weight"][-2:], torch.zeros(2, spec.hidden))
    back = to_hf(shards, spec)
    assert sorted(back) == sorted(hf)
    assert [k for k in hf if not torch.equal(back[k], hf[k])] == []
    assert ("output_layer.weight" in shards[0]) is not tied


def test_each_rank_holds_whole_query_groups_in_megatron_order():
    """Rank r's fused q/k/v is [q of group g, k_g, v_g] for its own groups g, and its fc1 is
    [gate_r; up_r]: what Megatron's column-parallel layers compute with."""
    spec = ModelSpec.of(hf_config())
    hf = random_hf(spec)
    d, per_group = spec.head_dim, spec.heads // spec.kv_heads
    p = "model.layers.0.self_attn."
    for rank in range(3):  # tp = 3: one group each
        qkv = to_megatron(hf, spec, 3, rank)["decoder.layers.0.self_attention.linear_qkv.weight"]
        q = hf[p + "q_proj.weight"][rank * per_group * d:(rank + 1) * per_group * d]
        k = hf[p + "k_proj.weight"][rank * d:(rank + 1) * d]
        v = hf[p + "v_proj.weight"][rank * d:(rank + 1) * d]
        assert torch.equal(qkv, torch.cat([q, k, v]))
    spec = ModelSpec.of(hf_config(num_key_value_heads=2))
    hf = random_hf(spec)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    for rank in range(2):  # tp = 2: 20 of the 40 gate rows and 20 of the 40 up rows each
        fc1 = to_megatron(hf, spec, 2, rank)["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate[rank * 20:(rank + 1) * 20], up[rank * 20:(rank + 1) * 20]]))


def test_llama_has_no_qkv_bias_and_reads_its_fields():
    spec = ModelSpec.of(hf_config(architectures=["LlamaForCausalLM"], head_dim=16, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_theta": 5e5, "rope_type": "default"}))
    assert (spec.qkv_bias, spec.head_dim, spec.norm_eps, spec.rope_theta) == (False, 16, 1e-5, 5e5)
    assert not [e for e in table(spec) if e.megatron.endswith(".bias")]


def test_a_tensor_parallel_size_that_splits_a_query_group_is_refused():
    with pytest.raises(MappingError, match="tp=2 does not divide the 3 kv heads"):
        to_megatron(random_hf(ModelSpec.of(hf_config())), ModelSpec.of(hf_config()), 2, 0)


@pytest.mark.parametrize("over, field", [
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 32.0}}, "rope_parameters"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
])
def test_configs_the_backend_cannot_carry_are_refused_naming_the_field(over, field):
    with pytest.raises(MappingError, match=field):
        ModelSpec.of(hf_config(**over))


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_hold_their_layers_and_put_back_together_exactly(tied):
    spec = ModelSpec.of(hf_config(num_hidden_layers=4, tie_word_embeddings=tied))
    shard = to_megatron(random_hf(spec), spec, 1, 0)
    stages = [to_stage(shard, spec, 2, s) for s in range(2)]
    first, last = stages
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" in last
    assert "embedding.word_embeddings.weight" not in last and "output_layer.weight" not in first
    # the second stage's layer 0 is the model's layer 2
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(last[name], shard[name.replace("layers.0", "layers.2")])
    assert not any("layers.2" in k or "layers.3" in k for k in first)
    if tied:  # the last stage's output layer is a copy of the embedding
        assert torch.equal(last["output_layer.weight"], shard["embedding.word_embeddings.weight"])
    back = from_stages(stages, spec)
    assert sorted(back) == sorted(shard) and all(torch.equal(back[k], shard[k]) for k in shard)
    assert set(stage_kinds(spec, 2, 1)) == set(last)
