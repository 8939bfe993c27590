"""Low-precision model parameters with fp32 master weights: Megatron's mixed precision, in small.

Megatron runs a bf16 model as bf16 *parameters* (its `Float16Module`), not as fp32 parameters
under autocast: its activation recompute re-runs layers in the backward pass outside any
autocast region, so under autocast a recomputed layer would multiply bf16 activations by
fp32 weights and fail. `MasterWeights` is the optimizer side of that choice (what Megatron's
`Float16OptimizerWithFloat16Params` does, without its fused kernels):

- every parameter that is not fp32 gets an fp32 master copy; fp32 parameters are their own
  masters (an fp32 model pays nothing);
- gradients are accumulated into the master's `.grad` in fp32 as soon as each micro-batch's
  backward produces them (a post-accumulate hook), and the low-precision `.grad` is dropped:
  summing micro-batches in bf16 would lose the small ones;
- `torch.optim.AdamW` steps the masters (its state is fp32), then the parameters are set to
  the masters rounded to their dtype.

Invariant: after `step()` (and after `load_masters`) every parameter equals its master
rounded to the parameter's dtype. It quacks as the optimizer `trainer/step.py` uses
(`param_groups`, `zero_grad`, `step`, `state_dict`, `load_state_dict`).
"""
from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.named_masters: list[tuple[str, torch.Tensor]] = []
        for name, p in named:
            master = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            if master is not p:
                p.register_post_accumulate_grad_hook(_into(master))
            self.named_masters.append((name, master))
        self.masters = [m for _, m in self.named_masters]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.param_groups = self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self._copy_to_params()

    def _copy_to_params(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def master_state(self) -> dict[str, torch.Tensor]:
        """The fp32 masters by parameter name (what a checkpoint keeps)."""
        return {name: m.detach() for name, m in self.named_masters}

    @torch.no_grad()
    def load_masters(self, state: dict[str, torch.Tensor]) -> None:
        for name, m in self.named_masters:
            m.copy_(state[name])
        self._copy_to_params()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def _into(master: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return hook
