"""A served `BatchReply` as micro-batches for a causal LM, sized by tokens, trained tokens flat.

Memory scales with tokens, not with batch × longest sequence: rows are sorted by length and
packed greedily into micro-batches of at most `max_tokens` (rows × the longest row in the
micro-batch, i.e. padding included; 0: one micro-batch), so a long sequence does not pad a
batch of short ones. Each row is right-padded within its micro-batch.

Only the tokens a policy trains on need a log-probability: the target at position j (the
token at j+1) is kept when its loss mask is 1, as a flat index into the micro-batch's
(rows, length - 1) grid, with its behaviour logprob, weight version and its row's advantage.
`TokenBatch.of_rows` builds one from any list of token rows (every position a target), for
scoring whole sequences in tests and parity checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from astraflow.protocol.messages import BatchReply


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # (B, L) right-padded
    positions: torch.Tensor  # (N,) flat indices into (B, L - 1): where the trained targets are
    targets: torch.Tensor  # (N,) token ids
    behaviour_logp: torch.Tensor  # (N,)
    versions: torch.Tensor  # (N,) weight version that generated each target
    advantages: torch.Tensor  # (N,) the advantage of each target's row
    rows: np.ndarray  # (B,) the rows of the served batch, in this micro-batch's order

    @property
    def tokens(self) -> int:
        return len(self.targets)

    def to(self, device: torch.device) -> "TokenBatch":
        return TokenBatch(*(getattr(self, f).to(device) if isinstance(getattr(self, f), torch.Tensor)
                            else getattr(self, f) for f in self.__dataclass_fields__))

    @staticmethod
    def of_rows(rows: list[list[int]], pad_id: int = 0, first: list[int] | None = None) -> "TokenBatch":
        """Targets: every token of each row from `first[i]` on (default: all but the first);
        behaviour, versions and advantages zero."""
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        keep = torch.zeros(len(rows), width - 1, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            keep[i, (first[i] if first else 1) - 1: len(row) - 1] = True
        positions = torch.nonzero(keep.reshape(-1)).squeeze(-1)
        zeros = torch.zeros(len(positions))
        return TokenBatch(ids, positions, ids[:, 1:].reshape(-1)[positions], zeros, zeros.long(), zeros,
                          np.arange(len(rows)))


def pack_rows(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Row indices grouped into micro-batches of at most `max_tokens` padded tokens each, by
    length (a row longer than the budget goes alone)."""
    order = np.argsort(lengths, kind="stable")
    if max_tokens <= 0:
        return [order] if len(order) else []
    groups, current = [], []
    for i in order:  # ascending: the row just added is the longest of its group
        if current and (len(current) + 1) * int(lengths[i]) > max_tokens:
            groups.append(np.array(current))
            current = []
        current.append(int(i))
    if current:
        groups.append(np.array(current))
    return groups


def micro_batches(reply: BatchReply, rows: np.ndarray, max_tokens: int, pad_id: int) -> list[TokenBatch]:
    """The served rows `rows` (a minibatch) as micro-batches of at most `max_tokens`."""
    t = reply.trajectories
    lengths = t.lengths[rows]
    return [_micro_batch(reply, rows[group], pad_id) for group in pack_rows(lengths, max_tokens)]


def _micro_batch(reply: BatchReply, rows: np.ndarray, pad_id: int) -> TokenBatch:
    """Rows right-padded to the longest; the trained targets found with whole-array indexing."""
    t = reply.trajectories
    lengths = t.lengths[rows].astype(np.int64)
    width = int(lengths.max())
    col = np.arange(width)
    valid = col[None, :] < lengths[:, None]
    src = np.minimum(t.offsets[rows][:, None] + col[None, :], len(t.tokens) - 1)  # clipped where not valid
    ids = np.where(valid, t.tokens[src], pad_id).astype(np.int64)
    # the token at position j + 1 is predicted at position j: targets and their masks shift by one
    keep = valid[:, 1:] & (t.loss_mask[src[:, 1:]] == 1)
    flat = np.flatnonzero(keep)
    at = src[:, 1:].reshape(-1)[flat]
    advantages = reply.advantages[rows].astype(np.float32)[flat // max(width - 1, 1)]
    return TokenBatch(torch.from_numpy(ids), torch.from_numpy(flat), torch.from_numpy(t.tokens[at].astype(np.int64)),
                      torch.from_numpy(t.logprobs[at].astype(np.float32)),
                      torch.from_numpy(t.versions[at].astype(np.int64)), torch.from_numpy(advantages), rows)
