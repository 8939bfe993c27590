"""Low-precision model parameters with fp32 master weights, optionally sharded over the
data-parallel replicas: Megatron's mixed precision and distributed optimizer, in small.

Megatron runs a bf16 model as bf16 *parameters* (its `Float16Module`), not as fp32 parameters
under autocast: its activation recompute re-runs layers in the backward pass outside any
autocast region, so under autocast a recomputed layer would multiply bf16 activations by
fp32 weights and fail. `MasterWeights` is the optimizer side of that choice (what Megatron's
`Float16OptimizerWithFloat16Params` does, without its fused kernels):

- gradients are accumulated in fp32 as soon as each micro-batch's backward produces them (a
  post-accumulate hook moves a low-precision `.grad` into an fp32 accumulator; an fp32
  parameter accumulates in its own `.grad`): summing micro-batches in bf16 would lose the
  small ones. `named_grads` are these accumulators, which the backend synchronises and clips;
- `torch.optim.AdamW` steps fp32 master copies (an fp32 parameter is its own master: an fp32
  model pays nothing), then the parameters are set to the masters rounded to their dtype.

With `shards` > 1 (`trainer.distributed_optimizer`, as Megatron's distributed optimizer /
ZeRO stage 1) the masters and the AdamW state are split over the data-parallel replicas:
each parameter has one owner (`owners`: whole parameters, balanced by size, the same on every
replica), only the owner keeps its master and AdamW state and steps it, and then broadcasts
the updated parameter to the other replicas. That divides the 12 bytes a parameter of fp32
master, first and second moment by the number of replicas; the gradients stay whole on every
replica (they are averaged there before the step), at the cost of one broadcast of the
parameters per step.

Invariants: after `step()` (and after `load`) every parameter equals its master rounded to
the parameter's dtype, on every replica. `state()` is this replica's part of a checkpoint
(the masters and AdamW state it owns, by parameter name: it loads into any number of
shards, `load` takes what the new owner needs from all parts). It quacks as the optimizer
`trainer/step.py` uses (`param_groups`, `zero_grad`, `step`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def owners(sizes: list[int], shards: int) -> list[int]:
    """The shard that owns each parameter: the largest first, each to the least loaded shard
    (ties to the lowest index), so that every replica computes the same assignment."""
    load, out = [0] * shards, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        out[i] = min(range(shards), key=lambda s: (load[s], s))
        load[out[i]] += sizes[i]
    return out


class MasterWeights:
    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, shards: int = 1, shard: int = 0,
                 group: Any = None) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shard, self.group = shard, group
        self.owner = owners([p.numel() for p in self.params], shards)
        self.acc: list[torch.Tensor | None] = [None] * len(named)  # fp32 gradients of low-precision parameters
        self.masters: dict[int, torch.Tensor] = {}  # index -> fp32 master, for the parameters this shard owns
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32:
                p.register_post_accumulate_grad_hook(self._into(i))
            if self.owner[i] == shard:
                self.masters[i] = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
        if not self.masters:
            raise ValueError(f"distributed optimizer: {shards} shards for {len(named)} parameters leave shard "
                             f"{shard} nothing to own")
        self.inner = torch.optim.AdamW(list(self.masters.values()), lr=lr, weight_decay=weight_decay)
        self.param_groups = self.inner.param_groups

    def _into(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.acc[i] is None:
                self.acc[i] = p.grad.float()
            else:
                self.acc[i].add_(p.grad)
            p.grad = None

        return hook

    def grad(self, i: int) -> torch.Tensor | None:
        return self.params[i].grad if self.params[i].dtype == torch.float32 else self.acc[i]

    @property
    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter's fp32 gradient (accumulated over the micro-batches), by name; a
        parameter without one (unused in the minibatch) gets zeros, for the collectives."""
        out = []
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            if self.grad(i) is None:
                if p.dtype == torch.float32:
                    p.grad = torch.zeros_like(p)
                else:
                    self.acc[i] = torch.zeros_like(p, dtype=torch.float32)
            out.append((name, self.grad(i)))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.acc = [None] * len(self.params)
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for i, master in self.masters.items():
            if master is not self.params[i]:
                master.grad = self.grad(i)
        self.inner.step()
        self._copy_to_params()

    def _copy_to_params(self) -> None:
        """Every parameter from its master, here or (sharded) broadcast by its owner."""
        for i, master in self.masters.items():
            if master is not self.params[i]:
                self.params[i].copy_(master)
        if self.group is not None:
            for i, p in enumerate(self.params):
                dist.broadcast(p.data, src=dist.get_global_rank(self.group, self.owner[i]), group=self.group)

    def state(self) -> dict[str, dict[str, Any]]:
        """This shard's masters and their AdamW state, by parameter name (a checkpoint's part)."""
        return {self.names[i]: {"master": m.detach().clone(), "adam": dict(self.inner.state.get(m, {}))}
                for i, m in self.masters.items()}

    @torch.no_grad()
    def load(self, parts: dict[str, dict[str, Any]]) -> None:
        """Every parameter from a checkpoint's parts (all shards' `state()`, merged), and the
        masters and AdamW state of those this shard owns."""
        missing = sorted(set(self.names) - set(parts))
        if missing:
            raise ValueError(f"checkpoint: no master weights for {missing}")
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            p.copy_(parts[name]["master"])
            if i in self.masters:
                master = self.masters[i]
                master.copy_(parts[name]["master"])
                # the moments on the master's device, the step count on the CPU (as AdamW keeps it)
                self.inner.state[master] = {k: v.clone() if k == "step" else v.to(master.device, copy=True)
                                            for k, v in parts[name]["adam"].items()}
