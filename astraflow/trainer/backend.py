"""The trainer backend contract: what differs between training a policy with plain torch and
with Megatron, behind one small interface. Everything else (leasing batches, `Ready` and
`Consumed`, checkpoint bookkeeping, publishing, metrics) is `trainer/loop.py`, shared.

A backend is built from the policy's starting model directory and the run's config, for one
rank of a trainer group of `world` ranks (torch.distributed is initialised before it is
built when `world > 1`). The group is `data_world` model replicas of tp x pp ranks each: the
ranks of one replica (`member` 0 .. tp x pp - 1) train on the same rows, the replicas on the
rows dealt to their `data_rank`. `train_step` takes this rank's share of a served batch and
returns the step's statistics (the metric columns it owns: loss, clip_frac, is_weight,
behaviour_kl, entropy, grad_norm, completion_len, version_lag, and kl_ref with a reference
term); `hf_state_dict` is the model in Hugging Face layout, in full, on rank 0 (what the
engines load), published in `publish_dtype`; `save`/`load` are the backend's checkpoint
state (model, optimizer, step), written atomically as `step-<N>` entries of a directory.
`hf_state_dict` and `save` are called on every rank of the group, in the same order: where
the model is sharded they are collectives.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from astraflow.protocol.messages import BatchReply


class Backend(Protocol):
    publish_dtype: Any  # torch.dtype of published weights: the training dtype
    data_rank: int  # this rank's model replica: it is dealt the step's rows data_rank::data_world
    data_world: int  # model replicas (data-parallel ranks)
    data_group: Any  # the torch.distributed group of this rank's data-parallel peers (None: the world)
    member: int  # this rank within its replica (0 .. tp x pp - 1)

    def train_step(self, reply: BatchReply, step: int, lr: float) -> dict[str, float]: ...

    def hf_state_dict(self) -> dict[str, Any]: ...

    def save(self, ckpt_dir: Path, step: int) -> Path | None: ...

    def load(self, path: Path) -> int: ...
