"""One training step on a served batch, for any backend: minibatches, micro-batches, the
proximal policy, the decoupled-PPO loss and the KL term, and the step's statistics.

The rank's share of the batch is cut into `minibatches`, each one optimizer step; each
minibatch into micro-batches of at most `max_tokens_per_microbatch` tokens whose gradients
accumulate. The proximal policy is the weights before the step's first update: for the
first minibatch its own forward pass, detached; for the others, scored up front without
gradient. The loss (`trainer/loss.py`) is a token-mean over each minibatch's trained tokens
on all data-parallel ranks, so the gradient does not depend on how rows were cut into
micro-batches or dealt to ranks: each rank divides by the global token count / the
data-parallel size, and the backend averages gradients over the data-parallel ranks.

What differs between backends is behind `Steppable`: how a minibatch's micro-batches run
forward and backward (`schedule`: `Sequential`, one after another, for a model in one
stage; a pipeline for a model cut into stages, `trainer/megatron/pipeline.py`), sums over
data-parallel ranks (`data_sum`), and how the accumulated gradients are synchronised and
clipped before the optimizer step (`finish_gradients`, returning the gradient norm).
`Sequential` asks the backend how a micro-batch is scored (`scores`), how gradients
accumulate without synchronising (`accumulate`) and in which precision (`autocast`).
Every schedule computes a micro-batch's loss with `micro_loss`. Under a pipeline only the
last stage computes losses: the other stages' loss sums are empty.
"""
from __future__ import annotations

import contextlib
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from astraflow.protocol.messages import BatchReply
from astraflow.trainer.batch import TokenBatch, micro_batches
from astraflow.trainer.loss import LossSums, decoupled_ppo_loss
from astraflow.trainer.scoring import Scores


def compute_autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast in the compute dtype (off in fp32): what each backend's `autocast` returns."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def summed(value: float, world: int, device: torch.device, group: Any = None) -> float:
    """`value` summed over the `world` ranks of `group` (the default group when None)."""
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


class Scoring(Protocol):
    """What `Sequential` needs of a backend."""
    tcfg: Any  # config.schema.TrainerConfig

    def scores(self, batch: TokenBatch, train: bool) -> Scores: ...

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager: ...

    def autocast(self) -> contextlib.AbstractContextManager: ...


class Schedule(Protocol):
    def proximal(self, part: list[TokenBatch]) -> list[torch.Tensor | None]:
        """The logprobs of each micro-batch's trained tokens under the current weights, without
        gradient (None where this rank computes no loss)."""

    def forward_backward(self, part: list[TokenBatch], prox: list[torch.Tensor | None], normalizer: float
                         ) -> LossSums:
        """Forward and backward passes of a minibatch's micro-batches (`prox`: their proximal
        logprobs, None: the micro-batch's own, detached); the gradients accumulate."""


class Steppable(Protocol):
    tcfg: Any  # config.schema.TrainerConfig
    device: torch.device
    pad_id: int
    data_world: int  # data-parallel ranks
    model: torch.nn.Module
    optim: Any  # torch.optim.Optimizer, or what quacks as one (megatron/master.py)
    schedule: Schedule

    def data_sum(self, value: float) -> float: ...

    def finish_gradients(self) -> float: ...


def micro_loss(tcfg: Any, scores: Scores, prox: torch.Tensor | None, mb: TokenBatch, normalizer: float
               ) -> tuple[torch.Tensor, LossSums]:
    """A micro-batch's part of the minibatch's loss (decoupled PPO and the KL term) and its sums."""
    p = scores.logp.detach() if prox is None else prox
    loss, sums = decoupled_ppo_loss(scores.logp, p, mb.behaviour_logp, mb.advantages, tcfg.clip_eps, tcfg.is_cap,
                                    normalizer, scores.entropy)
    if scores.kl_ref is not None:
        kl = scores.kl_ref.sum()
        loss = loss + tcfg.ref_kl * kl / max(normalizer, 1.0)
        sums.kl_ref = float(kl.detach())
    return loss, sums


class Sequential:
    """Micro-batches one after another through the backend's `scores`: a model in one stage."""

    def __init__(self, b: Scoring) -> None:
        self.b = b

    def proximal(self, part: list[TokenBatch]) -> list[torch.Tensor | None]:
        with torch.no_grad(), self.b.autocast():
            return [self.b.scores(mb, train=False).logp.float() for mb in part]

    def forward_backward(self, part: list[TokenBatch], prox: list[torch.Tensor | None], normalizer: float
                         ) -> LossSums:
        sums = LossSums()
        for j, mb in enumerate(part):
            with self.b.accumulate(j == len(part) - 1), self.b.autocast():
                loss, mb_sums = micro_loss(self.b.tcfg, self.b.scores(mb, train=True), prox[j], mb, normalizer)
            loss.backward()
            sums.add(mb_sums)
        return sums


def train_step(b: Steppable, reply: BatchReply, step: int, lr: float) -> dict[str, float]:
    """Train on this rank's share of a step's batch; the step's statistics."""
    tcfg = b.tcfg
    b.model.train()
    n = len(reply.sample_ids)
    per = max(1, n // tcfg.minibatches)
    parts = [[mb.to(b.device) for mb in micro_batches(reply, np.arange(lo, min(lo + per, n)),
                                                       tcfg.max_tokens_per_microbatch, b.pad_id)]
             for lo in range(0, n, per)]
    # the proximal policy of the later minibatches: the weights before the step's first update
    prox = [[None] * len(part) if k == 0 else b.schedule.proximal(part) for k, part in enumerate(parts)]
    for group in b.optim.param_groups:
        group["lr"] = lr
    sums, grad_norm, lag, trained = LossSums(), 0.0, 0.0, 0
    for k, part in enumerate(parts):
        # the token-mean over the minibatch on all ranks; gradients are then averaged over ranks
        normalizer = b.data_sum(sum(mb.tokens for mb in part)) / b.data_world
        b.optim.zero_grad(set_to_none=True)
        sums.add(b.schedule.forward_backward(part, prox[k], normalizer))
        lag += sum(float((step - 1 - mb.versions).float().sum()) for mb in part)
        trained += sum(mb.tokens for mb in part)
        grad_norm = b.finish_gradients()
        b.optim.step()
    stats = {"loss": sums.loss / max(trained, 1), "clip_frac": sums.mean("clipped"),
             "is_weight": sums.mean("is_weight"), "behaviour_kl": sums.mean("behaviour_kl"),
             "entropy": sums.mean("entropy"), "grad_norm": grad_norm,
             "completion_len": trained / max(1, n), "version_lag": lag / trained if trained else 0.0}
    if tcfg.ref_kl:
        stats["kl_ref"] = sums.mean("kl_ref")
    return stats
