"""Log-probabilities of the trained tokens without a (batch, length, vocabulary) tensor.

The decoder body runs once over the micro-batch; the hidden states of the positions whose
targets are trained are gathered (N × hidden), and the output layer runs over them in
chunks of `chunk` positions. A chunk whose logits would take more than `CHECKPOINT_BYTES`
is checkpointed: its logits are recomputed in the backward pass instead of kept, so at most
one chunk's (chunk × vocabulary) logits exist at a time, forward or backward (smaller ones
are kept: recomputing them cost the tiny quickstart model 6% of its step for nothing).
Prompt positions never get logits at all.

Per trained token: log pi(target | prefix) of pi = softmax(logits / T), T the engines'
sampling temperature (the behaviour policy's distribution: scored at T=1 instead, the
on-policy ratio pi_prox / mu would differ from 1 on every token); the entropy of pi
(reported, no gradient); and with a reference model, KL(pi_ref || pi) over the vocabulary
(`loss.forward_kl`), whose gradient flows into pi only.

Rows are right-padded and scored without an attention mask: causal attention alone keeps
every real position from the pads that follow it, and the outputs at pads are never read.

`PolicyScorer` is the module a trainer wraps in DDP: the whole computation is its forward,
so DDP's gradient hooks see every parameter it uses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.loss import forward_kl

CHECKPOINT_BYTES = 64 << 20


@dataclass
class Scores:
    logp: torch.Tensor  # (N,) with gradient
    entropy: torch.Tensor  # (N,) no gradient
    kl_ref: torch.Tensor | None  # (N,) with gradient, when a reference model is given


def _body(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def trained_hidden(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Hidden states (N, hidden) of the positions whose targets are trained."""
    hidden = _body(model)(input_ids=batch.input_ids, use_cache=False).last_hidden_state[:, :-1]
    return hidden.reshape(-1, hidden.shape[-1])[batch.positions]


def _chunk(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float,
           ref_head: torch.nn.Module | None, h_ref: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(head(h).float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    if ref_head is None:
        return logp, entropy, torch.zeros_like(logp)
    with torch.no_grad():
        ref_all = torch.log_softmax(ref_head(h_ref).float() / temperature, dim=-1)
    return logp, entropy, forward_kl(ref_all, logp_all)


class PolicyScorer(torch.nn.Module):
    """The policy (an HF causal LM) as the function the RL loss needs: `forward(batch)` -> Scores."""

    def __init__(self, model: torch.nn.Module, temperature: float, chunk: int = 1024,
                 ref: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.model, self.chunk = model, max(1, chunk)
        self.temperature = temperature if temperature > 0 else 1.0
        self.ref = [ref]  # a list: not a submodule (frozen, never DDP's business)

    def forward(self, batch: TokenBatch) -> Scores:
        h = trained_hidden(self.model, batch)
        ref = self.ref[0]
        h_ref = None
        if ref is not None:
            with torch.no_grad():
                h_ref = trained_hidden(ref, batch)
        head, ref_head = self.model.get_output_embeddings(), ref.get_output_embeddings() if ref is not None else None
        big = min(self.chunk, len(batch.targets)) * head.weight.shape[0] * 4 > CHECKPOINT_BYTES
        outs = []
        for lo in range(0, len(batch.targets), self.chunk):
            part = slice(lo, lo + self.chunk)
            args = (head, h[part], batch.targets[part], self.temperature, ref_head,
                    h_ref[part] if h_ref is not None else None)
            outs.append(checkpoint(_chunk, *args, use_reentrant=False) if big and torch.is_grad_enabled()
                        else _chunk(*args))
        if not outs:  # nothing trained in this micro-batch: empty, but every parameter in the graph (DDP)
            empty = h.sum(-1) + head(h[:0]).sum()
            return Scores(empty, empty.detach(), empty if ref is not None else None)
        logp, entropy, kl = (torch.cat(x) for x in zip(*outs))
        return Scores(logp, entropy, kl if ref is not None else None)


def sequence_logprobs(model: torch.nn.Module, rows: list[list[int]], temperature: float) -> list[torch.Tensor]:
    """log pi(token | prefix) of every token after the first, per row: the trainer's own scoring
    of whole sequences (parity tests, teacher-forced checks of the engines)."""
    batch = TokenBatch.of_rows(rows)
    with torch.no_grad():
        logp = PolicyScorer(model, temperature)(batch).logp
    out, at = [], 0
    for row in rows:
        out.append(logp[at:at + len(row) - 1])
        at += len(row) - 1
    return out
