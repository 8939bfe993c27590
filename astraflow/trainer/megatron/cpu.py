"""Megatron-core on a machine without a GPU: its few CUDA-only calls, redirected to the CPU.

megatron-core 0.16 assumes a GPU in a handful of places that a CPU run reaches: buffers and
the rotary `inv_freq` are put on `torch.cuda.current_device()` (the all-gather and
all-reduce buffers of tensor parallelism, `GlobalMemoryBuffer`, the attention's rotary
embedding, the pipeline's receive buffers), the pipeline schedules count tokens in a tensor
made on `device="cuda"` and synchronise the device after sending, and the dropout RNG
tracker saves and restores CUDA generator states. `redirect_to_cpu()` points exactly those
at the CPU, inside megatron's own modules only:

- each loaded `megatron.core` module's global `torch` becomes a view of torch whose `cuda`
  answers `current_device()` with the CPU device, seeds/reads the CPU generator and has
  nothing to synchronise, and whose `zeros` makes a tensor asked for on "cuda" on the CPU;
  every other attribute is torch's own, and torch itself (and every other library) is
  untouched;
- the RNG tracker's `_get_cuda_rng_state` / `_set_cuda_rng_state` read and set the CPU
  generator's state.

Invariants: it is called only when no GPU is present (`redirect_to_cpu` refuses otherwise,
so a GPU run can never be quietly moved to the CPU), after megatron's modules are imported
(`astraflow.trainer.megatron.model` imports what the backend uses, then calls it), and it is
idempotent; it imports the pipeline modules itself, so that they are among those redirected.
Other calls that name `"cuda"` literally (the default causal mask) are avoided by the
callers instead: the backend passes its own attention mask. Megatron's optimizer is not
used on a CPU (`torch.optim.AdamW` is).
"""
from __future__ import annotations

import sys
import types
from typing import Any

import torch

_CPU = torch.device("cpu")


class _CpuCuda(types.SimpleNamespace):
    """What a Megatron module sees as `torch.cuda` on a CPU-only machine."""

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Nothing runs asynchronously on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """torch, except for `cuda` (`_CpuCuda`)."""

    cuda = _CpuCuda()

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, device=_CPU if str(device).startswith("cuda") else device, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_VIEW = _TorchOnCpu("torch")


def redirect_to_cpu() -> None:
    """Point megatron-core's CUDA-only calls at the CPU (see the module's docstring)."""
    if torch.cuda.is_available():
        raise RuntimeError("redirect_to_cpu: a GPU is present; Megatron runs on it as it is")
    import megatron.core.pipeline_parallel.schedules  # noqa: F401 (redirected below)
    from megatron.core.tensor_parallel import random

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _VIEW
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
