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

Loss is averaged over all trainable tokens of the batch (token-mean). The token-mean entropy
of pi_theta is reported (not optimised): its fall shows the policy sharpening.

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
class LossStats:
    loss: float
    clip_frac: float
    is_weight: float
    behaviour_kl: float
    entropy: float


def decoupled_ppo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behaviour: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
                       is_cap: float, entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
    """All token tensors are (batch, tokens); `advantages` is (batch,); `mask` selects trained
    tokens; `entropy` (of pi_theta per position), if given, is reported."""
    weight = torch.exp(logp_prox - logp_behaviour).clamp(max=is_cap).detach()
    ratio = torch.exp(logp - logp_prox.detach())
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    loss = -token_mean(weight * surrogate, mask)
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = LossStats(loss=float(loss), clip_frac=float(token_mean(clipped, mask)),
                          is_weight=float(token_mean(weight, mask)),
                          behaviour_kl=float(token_mean(logp_behaviour - logp_prox, mask)),
                          entropy=float(token_mean(entropy, mask)) if entropy is not None else float("nan"))
    return loss, stats


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` (batch, tokens) over the tokens `mask` selects (0 if it selects none)."""
    mask = mask.float()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def forward_kl(ref_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(pi_ref || pi_theta) per trained token, token-mean; both (batch, tokens, vocab)."""
    return token_mean((ref_logp.exp() * (ref_logp - logp)).sum(-1), mask)
