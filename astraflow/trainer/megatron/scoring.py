"""Log-probabilities of the trained tokens with the vocabulary split across tensor-parallel ranks.

The same quantities as `trainer/scoring.py` (per trained token: log pi(target | prefix) at the
engines' temperature with gradient, the entropy of pi without, and with a reference model
KL(pi_ref || pi) with gradient into pi), computed so that no rank ever holds the logits of
the whole vocabulary: each rank multiplies the trained positions' hidden states by its slice
of the output layer (`output_layer` with `gather_output=False`) and the softmax's maximum,
normaliser, target logit, entropy and KL sums are all-reduced over the tensor-parallel group
(`reduce_from_tensor_model_parallel_region`: a sum forward, the identity backward, as each
rank's slice feeds the replicated result). Padded vocabulary rows (`mapping.py`) get -inf.

Positions are scored in chunks of `chunk` trained tokens; a chunk whose logits slice would
exceed `CHECKPOINT_BYTES` is recomputed in the backward pass (as in `trainer/scoring.py`).
At tp = 1 every collective is the identity and this is the plain log-softmax.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint

from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.megatron.model import hidden_states
from astraflow.trainer.scoring import CHECKPOINT_BYTES, Scores


def _local_logits(model: torch.nn.Module, h: torch.Tensor, temperature: float, vocab: int) -> torch.Tensor:
    """This rank's vocabulary slice of the logits / T (fp32), padded rows at -inf."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(h[:, None], weight=weight)
    z = logits[:, 0].float() / temperature
    lo = parallel_state.get_tensor_model_parallel_rank() * z.shape[-1]
    if lo + z.shape[-1] > vocab:
        z = z.masked_fill(torch.arange(lo, lo + z.shape[-1], device=z.device) >= vocab, float("-inf"))
    return z


def _log_normalizer(z: torch.Tensor) -> torch.Tensor:
    """log sum_v exp z_v over the whole vocabulary, per row."""
    m = z.max(-1).values.detach()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return m + reduce_from_tensor_model_parallel_region((z - m[:, None]).exp().sum(-1)).log()


def _vocab_sum(x: torch.Tensor) -> torch.Tensor:
    return reduce_from_tensor_model_parallel_region(x.sum(-1))


def _chunk(model: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, vocab: int,
           ref: torch.nn.Module | None, h_ref: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = _local_logits(model, h, temperature, vocab)
    lse = _log_normalizer(z)
    lo = parallel_state.get_tensor_model_parallel_rank() * z.shape[-1]
    local = targets - lo
    mine = (local >= 0) & (local < z.shape[-1])
    target_z = _vocab_sum((z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]) * mine[:, None]))
    logp = target_z - lse
    valid = torch.isfinite(z)
    with torch.no_grad():
        p = (z - lse[:, None]).exp()
        entropy = lse - _vocab_sum(torch.where(valid, p * z, 0.0))
    if ref is None:
        return logp, entropy, torch.zeros_like(logp)
    with torch.no_grad():
        z_ref = _local_logits(ref, h_ref, temperature, vocab)
        logp_ref = z_ref - _log_normalizer(z_ref)[:, None]
        p_ref = logp_ref.exp()
    # KL(ref || pi) = sum_v p_ref (log p_ref - z_v) + lse, since sum_v p_ref = 1
    kl = _vocab_sum(torch.where(valid, p_ref * (logp_ref - z), 0.0)) + lse
    return logp, entropy, kl


def trained(hidden: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """The (batch, length, hidden) states at the positions whose next token is trained."""
    h = hidden[:, :-1]
    return h.reshape(-1, h.shape[-1])[batch.positions]


def score(model: torch.nn.Module, batch: TokenBatch, temperature: float, vocab: int, chunk: int = 1024,
          ref: torch.nn.Module | None = None, padding_idx: int | None = None) -> Scores:
    """`Scores` of a micro-batch's trained tokens (see the module's docstring) for a model in
    one pipeline stage; `padding_idx`: `model.embed`."""
    h = trained(hidden_states(model, batch.input_ids, padding_idx), batch)
    h_ref = None
    if ref is not None:
        with torch.no_grad():
            h_ref = trained(hidden_states(ref, batch.input_ids, padding_idx), batch)
    return score_hidden(model, h, batch.targets, temperature, vocab, chunk, ref, h_ref)


def score_hidden(model: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, vocab: int,
                 chunk: int = 1024, ref: torch.nn.Module | None = None, h_ref: torch.Tensor | None = None) -> Scores:
    """`Scores` from the final hidden states `h` of the trained positions (and the reference
    model's, `h_ref`), through this rank's output layer."""
    temperature = temperature if temperature > 0 else 1.0
    chunk = max(1, chunk)
    n = len(targets)
    if n == 0:  # nothing trained in this micro-batch
        empty = h[:, 0]
        return Scores(empty, empty.detach(), empty if ref is not None else None)
    local_vocab = model.output_layer.output_size_per_partition
    big = min(chunk, n) * local_vocab * 4 > CHECKPOINT_BYTES
    outs = []
    for lo in range(0, n, chunk):
        part = slice(lo, lo + chunk)
        args = (model, h[part], targets[part], temperature, vocab, ref,
                h_ref[part] if h_ref is not None else None)
        outs.append(checkpoint(_chunk, *args, use_reentrant=False) if big and torch.is_grad_enabled()
                    else _chunk(*args))
    logp, entropy, kl = (torch.cat(x) for x in zip(*outs))
    return Scores(logp, entropy, kl if ref is not None else None)
