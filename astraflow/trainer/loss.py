"""The RL objective: GRPO advantages with decoupled PPO (Hilton et al., 2022).

Three policies meet in an asynchronous system: the behaviour policy mu that generated a
token (its logprob travels with the sample, possibly several versions old), the proximal
policy pi_prox (the trainer's weights at the start of this step) and pi_theta (being
optimised). Decoupled PPO clips the ratio pi_theta / pi_prox — the trust region is around
where the trainer is, not where a stale worker was — and corrects for staleness with the
importance weight pi_prox / mu, truncated at `is_cap` so one very stale token cannot
dominate. With mu = pi_prox (fully on-policy) it is exactly PPO-clip. Why not plain
truncated IS against mu alone: the clip region would then be centred on an old policy, and
a few versions of lag would clip away most of the signal.

Tensors are per trained token (the trainer keeps only those: `trainer/batch.py`). The loss is
a token-mean over the optimizer step's trained tokens: each micro-batch adds its tokens' sum
divided by `normalizer`, the step's token count (all ranks together), so accumulated
micro-batches give the gradient of one big batch. The token-mean entropy of pi_theta is
reported (not optimised): its fall shows the policy sharpening.

`forward_kl` is KL(pi_ref || pi_theta) to the starting policy, added with weight
`trainer.ref_kl`. This direction, not GRPO's KL(pi_theta || pi_ref): as pi_theta drops a token
the reference gave probability, the gradient on its logit stays about pi_theta - pi_ref
instead of vanishing, so an answer that is rarely right keeps being sampled until the policy
can tell its prompts apart (an entropy bonus, whose pull vanishes with the probability, did
not keep it on the quickstart).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossSums:
    """Sums over trained tokens (divide by `tokens` for means), accumulated over micro-batches."""
    tokens: int = 0
    loss: float = 0.0
    clipped: float = 0.0
    is_weight: float = 0.0
    behaviour_kl: float = 0.0
    entropy: float = 0.0
    kl_ref: float = 0.0

    def add(self, other: "LossSums") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def mean(self, name: str) -> float:
        return getattr(self, name) / self.tokens if self.tokens else float("nan")


def decoupled_ppo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behaviour: torch.Tensor,
                       advantages: torch.Tensor, clip_eps: float, is_cap: float, normalizer: float,
                       entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, LossSums]:
    """All tensors are per trained token (same shape). Returns the loss contribution of these
    tokens (their sum divided by `normalizer`) and their sums for the step's statistics."""
    weight = torch.exp(logp_prox - logp_behaviour).clamp(max=is_cap).detach()
    ratio = torch.exp(logp - logp_prox.detach())
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    total = -(weight * surrogate).sum()
    with torch.no_grad():
        sums = LossSums(tokens=int(logp.numel()), loss=float(total),
                        clipped=float(((ratio - 1).abs() > clip_eps).float().sum()), is_weight=float(weight.sum()),
                        behaviour_kl=float((logp_behaviour - logp_prox).sum()),
                        entropy=float(entropy.sum()) if entropy is not None else float("nan"))
    return total / max(normalizer, 1.0), sums


def forward_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_ref || pi_theta) per position; both (..., vocab) log-probabilities."""
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)
