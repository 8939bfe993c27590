"""A served `BatchReply` as padded tensors for a causal LM (right padding)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from astraflow.protocol.messages import BatchReply


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, L-1): input_ids shifted left
    loss_mask: torch.Tensor  # (B, L-1): which targets this policy trains on
    behaviour_logp: torch.Tensor  # (B, L-1)
    versions: torch.Tensor  # (B, L-1)
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,)

    def select(self, rows: slice) -> "TrainBatch":
        return TrainBatch(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


def to_tensors(reply: BatchReply, pad_id: int) -> TrainBatch:
    t = reply.trajectories
    n, width = len(t), int(t.lengths.max())
    ids = np.full((n, width), pad_id, np.int64)
    attn = np.zeros((n, width), np.int64)
    mask = np.zeros((n, width), np.float32)
    lp = np.zeros((n, width), np.float32)
    ver = np.full((n, width), -1, np.int64)
    for i in range(n):
        lo, hi = t.offsets[i], t.offsets[i + 1]
        k = hi - lo
        ids[i, :k] = t.tokens[lo:hi]
        attn[i, :k] = 1
        mask[i, :k] = t.loss_mask[lo:hi]
        lp[i, :k] = t.logprobs[lo:hi]
        ver[i, :k] = t.versions[lo:hi]
    # the token at position j is predicted from positions < j: targets and their masks shift by one
    return TrainBatch(torch.from_numpy(ids), torch.from_numpy(attn), torch.from_numpy(ids[:, 1:]),
                      torch.from_numpy(mask[:, 1:]), torch.from_numpy(lp[:, 1:]), torch.from_numpy(ver[:, 1:]),
                      torch.from_numpy(reply.advantages.astype(np.float32)),
                      torch.from_numpy(t.reward.astype(np.float32)))


def log_policy(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log pi(. | prefix) for every position, (B, L-1, V), of the policy the engines sample
    from: softmax(logits / temperature). Scoring at temperature 1 instead would make the
    on-policy ratio pi_prox / mu differ from 1 on every token (below 1 on likely tokens, above
    on unlikely ones), so the importance weights would reshape the gradient even with no lag.

    No attention mask: rows are right-padded, so causal attention alone keeps every real
    position from seeing a pad (pads only follow it) and the model builds no padding mask;
    the outputs at pads are never read (their targets are masked). No KV cache either."""
    logits = model(input_ids=batch.input_ids, use_cache=False).logits[:, :-1].float()
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)


def token_scores(model: torch.nn.Module, batch: TrainBatch, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the trainer needs of the minibatch it optimises: log pi(target | prefix) and the
    entropy of pi(. | prefix) (no gradient), each (B, L-1), and the whole `log_policy`."""
    logp = log_policy(model, batch, temperature)
    with torch.no_grad():  # reported, not optimised
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, batch.targets[..., None]).squeeze(-1), entropy, logp


def token_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log pi(target | prefix), (B, L-1): see `log_policy`."""
    return log_policy(model, batch, temperature).gather(-1, batch.targets[..., None]).squeeze(-1)
