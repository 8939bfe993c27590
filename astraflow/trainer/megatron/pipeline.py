"""Pipeline parallelism for the megatron backend: a minibatch's micro-batches through
megatron-core's one-forward-one-backward schedule across the pipeline stages.

Every stage runs the same micro-batches (the ranks of a model replica are served the same
rows). A stage's forward (`_forward`): the first embeds the tokens, every stage runs its
layers on its input (`model.decode`), a stage that is not the last sends (length, batch,
hidden) on. With a reference model (the KL term) the reference's hidden states travel in the
same tensor, concatenated on the hidden axis, and carry no gradient back. The last stage
scores the trained positions (`scoring.score_hidden`) and computes the loss
(`step.micro_loss`); the schedule sends the gradients back stage by stage. Micro-batches are
token-budgeted and differ in shape: the schedule exchanges each tensor's shape first
(`variable_seq_lengths`), and the loss is already the minibatch's token mean, so the
schedule does not rescale it (`calculate_per_token_loss`; both in `model.py`).

Loss sums and proximal logprobs exist on the last stage only; the other stages return
empty sums and None (`backend.py` broadcasts the step's statistics from the last stage).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.loss import LossSums
from astraflow.trainer.megatron.model import decode, embed, full_sequence, padded_length
from astraflow.trainer.megatron.scoring import score_hidden, trained
from astraflow.trainer.scoring import Scores
from astraflow.trainer.step import micro_loss


class Pipeline:
    """The `step.Schedule` of a megatron model cut into pipeline stages."""

    def __init__(self, b: Any) -> None:  # b: backend.MegatronBackend (it builds this)
        self.b = b
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()

    def _forward(self, mb: TokenBatch) -> torch.Tensor | Scores:
        """This stage's part of a micro-batch's forward pass: what it sends on, or the scores."""
        b, length = self.b, mb.input_ids.shape[1]
        if self.first:
            x = embed(b.model, mb.input_ids, b.padding_idx)
            with torch.no_grad():
                x_ref = embed(b.ref, mb.input_ids, b.padding_idx) if b.ref is not None else None
        else:  # what the schedule received from the stage before (`model.set_input_tensor`)
            received = b.model.decoder.input_tensor
            x, x_ref = (received, None) if b.ref is None else received.chunk(2, dim=-1)
        h = decode(b.model, x, padded_length(b.model, length))
        h_ref = None
        if b.ref is not None:
            with torch.no_grad():
                h_ref = decode(b.ref, x_ref.detach(), padded_length(b.ref, length))
        if not self.last:  # what is sent on must be contiguous (a layer's output can be a view)
            return (h if h_ref is None else torch.cat([h, h_ref], dim=-1)).contiguous()

        def final(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
            return trained(full_sequence(model, hidden, length).transpose(0, 1), mb)

        return score_hidden(b.model, final(b.model, h), mb.targets, b.temperature, b.spec.vocab,
                            b.tcfg.logprob_chunk_tokens, b.ref, final(b.ref, h_ref) if h_ref is not None else None)

    def _run(self, items: list[tuple[TokenBatch, Any]], loss: Any, forward_only: bool) -> list:
        """The schedule over `items` (micro-batch, extra): each stage's forward, on the last stage
        `loss(scores, mb, extra)` -> (loss, what to collect); the collected values (last stage)."""
        def forward_step(data: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb, extra = next(data)
            out = self._forward(mb)
            if not self.last:
                return out, None  # the schedule calls the loss function on the last stage only
            return out.logp, partial(_collect, loss, out, mb, extra)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(items), model=[self.b.model],
            num_microbatches=len(items), seq_length=max(mb.input_ids.shape[1] for mb, _ in items),
            micro_batch_size=max(mb.input_ids.shape[0] for mb, _ in items), forward_only=forward_only)

    def proximal(self, part: list[TokenBatch]) -> list[torch.Tensor | None]:
        with torch.no_grad():
            got = self._run([(mb, None) for mb in part],
                            lambda scores, mb, _: (scores.logp.sum() * 0, scores.logp.detach().float()), True)
        return got if self.last else [None] * len(part)

    def forward_backward(self, part: list[TokenBatch], prox: list[torch.Tensor | None], normalizer: float
                         ) -> LossSums:
        got = self._run(list(zip(part, prox)),
                        lambda scores, mb, p: micro_loss(self.b.tcfg, scores, p, mb, normalizer), False)
        sums = LossSums()
        for s in got:
            sums.add(s)
        return sums


def _collect(loss: Any, scores: Scores, mb: TokenBatch, extra: Any, _output: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The schedule's loss function: (loss, token count, what to collect)."""
    value, collected = loss(scores, mb, extra)
    return value, torch.tensor(mb.tokens, dtype=torch.int), collected
