"""A megatron-core GPTModel for an HF model directory, and the parallel groups it runs in.

`init_parallel(tp, pp)` sets up megatron's model-parallel groups over the already
initialised torch.distributed world (data parallelism is what remains: world / (tp × pp)).
`build_model(spec, tp, pp, dtype)` builds the `GPTModel` of an HF `config.json`
(`mapping.ModelSpec`), its parameters in `dtype`, with megatron-core's local layer spec (no
TransformerEngine: it runs on a CPU and on any GPU) whose core attention is PyTorch's fused
SDPA and whose norms run under sequence parallelism (`layers.py`): RMSNorm with the config's eps, SwiGLU MLP, GQA with
`num_query_groups`, q/k/v biases when the family has them, RoPE with the config's theta,
tied or untied embeddings, no dropout (the RL loss's ratios compare two forward passes of
the same weights: dropout would make them differ). The weights come from `load_hf` (via
`mapping.to_megatron`), not from Megatron's initialisation, which is skipped.

`build_model` builds this pipeline stage's part of the model (megatron's parallel state
says which: the embedding on the first stage, the final norm and output layer on the last).
With tied embeddings the output layer shares the embedding's weight when both are on one
stage; across stages the last one has a weight of its own (`mapping.to_stage`).

With `sequence_parallel` (tensor parallelism only) the activations between layers are split
along the sequence over the tensor-parallel ranks (Megatron's sequence parallelism: the norms
run on a slice, the linear layers all-gather and reduce-scatter instead of all-reducing):
rows are padded to a multiple of tp, and the last stage's output is gathered back whole
(`full_sequence`) before the output layer, which then runs as without it.

`embed(model, input_ids)` is the first stage's (length, batch, hidden) input to the decoder;
`decode(model, hidden, length)` runs this stage's layers (final norm included on the last
stage) on it, or on what a later stage received from the one before; `hidden_states` is
both for a model in one stage, as
(batch, length, hidden): the output layer is applied by `scoring.py` to the trained
positions only. The causal mask is passed explicitly (Megatron's default one is built on
`"cuda"`).

Without a GPU, `cpu.redirect_to_cpu()` is applied once megatron's modules are imported.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from astraflow.trainer.megatron.layers import RMSNorm, SdpaAttention
from astraflow.trainer.megatron.spec import ModelSpec

if not torch.cuda.is_available():
    from astraflow.trainer.megatron.cpu import redirect_to_cpu

    redirect_to_cpu()


def init_parallel(tp: int, pp: int, seed: int = 0) -> None:
    """Megatron's tensor/pipeline/data-parallel groups over the current torch.distributed world,
    and its RNG tracker (which attention forks into even without dropout). Seeding the tracker
    seeds the default generator; on a CPU that is torch's own, so its state is kept."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    cpu_state = torch.get_rng_state()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.set_rng_state(cpu_state)


def transformer_config(spec: ModelSpec, tp: int, pp: int, dtype: torch.dtype, recompute: bool = False,
                       sequence_parallel: bool = False) -> TransformerConfig:
    extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if recompute else {}
    return TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, ffn_hidden_size=spec.intermediate,
        num_attention_heads=spec.heads, num_query_groups=spec.kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype,
        # the pipeline passes micro-batches of any shape (token-budgeted), and the loss is
        # already a token mean over the minibatch (trainer/step.py): the schedule must not rescale it
        # (the MoE token dispatcher is unused: a dense model; its default refuses variable lengths)
        variable_seq_lengths=True, calculate_per_token_loss=True, moe_token_dispatcher_type="alltoall",
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, **extra)


def build_model(spec: ModelSpec, tp: int, pp: int = 1, dtype: torch.dtype = torch.float32, recompute: bool = False,
                sequence_parallel: bool = False) -> GPTModel:
    """This rank's pipeline stage of the model (see the module's docstring)."""
    config = transformer_config(spec, tp, pp, dtype, recompute, sequence_parallel)
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer.submodules.self_attention.submodules.core_attention = SdpaAttention  # layers.py
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * (spec.layers // pp), layer_norm=RMSNorm)
    model = GPTModel(config, block, vocab_size=spec.padded_vocab(tp),
                     max_sequence_length=spec.max_positions, position_embedding_type="rope",
                     rotary_base=spec.rope_theta, share_embeddings_and_output_weights=spec.tied and pp == 1,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    if model.post_process:  # its input is the whole sequence, gathered by `full_sequence`
        model.output_layer.sequence_parallel = False
    # the norms (torch's RMSNorm without Apex) ignore params_dtype; Megatron's Float16Module casts
    # the whole model the same way (the rotary frequencies are no buffer: they stay fp32)
    return model.to(dtype)


def parameters(model: GPTModel) -> dict[str, torch.Tensor]:
    """The model's parameters by name (no `_extra_state` entries)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_shard(model: GPTModel, shard: dict[str, torch.Tensor]) -> None:
    """Copy this rank's parameters (`mapping.to_megatron`) into the model; every one must be there."""
    own = parameters(model)
    missing, extra = sorted(set(own) - set(shard)), sorted(set(shard) - set(own))
    if missing or extra:
        raise ValueError(f"megatron parameters: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(shard[name])


def embed(model: GPTModel, input_ids: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """The decoder's input, (length, batch, hidden), for right-padded rows (first stage only).

    The embedding of `padding_idx` (the config's `pad_token_id`) gets no gradient from its
    lookups, as in the HF model (`nn.Embedding(padding_idx=...)`), so that both backends train
    the same weights (it matters where the pad token is also a real one: Qwen2.5's
    `<|endoftext|>`); its gradient through tied output weights is kept, as there.

    Under sequence parallelism the rows are padded (with `padding_idx`) to `padded_length`
    and the result is this rank's slice of the sequence."""
    extra = padded_length(model, input_ids.shape[1]) - input_ids.shape[1]
    if extra:
        input_ids = F.pad(input_ids, (0, extra), value=padding_idx or 0)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
    embedded = model.embedding(input_ids=input_ids, position_ids=positions)
    if padding_idx is not None:
        pad = (input_ids == padding_idx).T
        if model.config.sequence_parallel:
            pad = pad.chunk(parallel_state.get_tensor_model_parallel_world_size())[
                parallel_state.get_tensor_model_parallel_rank()]
        embedded = torch.where(pad[..., None], embedded.detach(), embedded)
    return embedded


def padded_length(model: GPTModel, length: int) -> int:
    """The sequence length the layers run at: a multiple of the tensor-parallel size under
    sequence parallelism (each rank holds an equal slice between layers)."""
    if not model.config.sequence_parallel:
        return length
    return -(-length // model.config.tensor_model_parallel_size) * model.config.tensor_model_parallel_size


def full_sequence(model: GPTModel, hidden: torch.Tensor, length: int) -> torch.Tensor:
    """The last stage's output over the whole sequence, (length, batch, hidden): gathered from
    the tensor-parallel ranks' slices under sequence parallelism (the gradient flows back to
    each rank's slice unreduced: the output layer's input already all-reduces it), padding cut."""
    if model.config.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    return hidden[:length]


def decode(model: GPTModel, hidden: torch.Tensor, length: int) -> torch.Tensor:
    """This stage's layers (causal attention) on `hidden`, (length, batch, hidden)."""
    if not model.pre_process:  # a later stage's decoder reads its input from there
        model.decoder.set_input_tensor(hidden)
    mask = torch.ones(length, length, dtype=torch.bool, device=hidden.device).triu(1)[None, None]
    return model.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=model.rotary_pos_emb(length))


def hidden_states(model: GPTModel, input_ids: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """(batch, length, hidden) after the final norm, for a model in one stage (`embed`)."""
    length = input_ids.shape[1]
    hidden = decode(model, embed(model, input_ids, padding_idx), padded_length(model, length))
    return full_sequence(model, hidden, length).transpose(0, 1)
