"""When work may start, beyond the default asynchronous schedule (pure functions of the state).

- Version barrier (`schedule.barrier`, async mode): a trainer's batch for step s waits until
  every other policy still training has published version s-1. Lock-step versions, while
  generation still overlaps training.
- Sync schedule (`schedule.mode: sync`), the conventional trainer-centred loop on the same
  components: tasks are leased only while no trainer is in the middle of a step, every policy
  still training is at the same version, the worker holds exactly those versions, and some
  policy's next batch is not yet covered by usable buffered plus in-flight samples — then
  only as many tasks as cover it; no batch is served until every policy still training has
  its batch (one policy training alone would move its version and stall the round). So each
  iteration generates one batch per policy with the latest weights, then the trainers train
  and publish, then the workers reload, then the next round.
- Under either coupling, a policy short of its next batch is not held back by another
  policy's full buffer (`short_of_a_batch`): that buffer's trainer is waiting for it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.dataflow.state import DataflowState

SYNC_RETRY_S = 0.05  # sync waits are short: the round starts as soon as weights are in


def training(state: "DataflowState") -> list[str]:
    """The policies whose trainers still have steps to take."""
    return [p for p in state.policy_names if not state.buffers[p].finished]


def short_of_a_batch(state: "DataflowState", needed: tuple[str, ...]) -> bool:
    """Whether a full buffer must not hold generation back: under a coupled schedule (sync
    rounds, the version barrier) a full policy's trainer may be waiting for another policy
    that is short of its next batch, and refusing the tasks that would complete it stalls
    both for good (a sync benchmark stopped at step 6 of 20: the verifier's 1,024 buffered
    samples, surplus from the rounds in which the solver's zero-advantage groups were
    filtered, blocked the 16 samples the solver lacked). The surplus is bounded: sync leases
    only what covers the missing batch, and samples past `max_staleness` are dropped."""
    if state.cfg.schedule.mode != "sync" and not state.cfg.schedule.barrier:
        return False  # independent trainers: the full one consumes and makes room on its own
    return any(_usable(state, p) < state.cfg.trainer_for(p).batch_size for p in training(state) if p in needed)


def barrier_blocks(state: "DataflowState", policy: str, step: int) -> bool:
    return any(state.buffers[q].trainer_version < step - 1 for q in training(state) if q != policy)


def sync_quota(state: "DataflowState", needed: tuple[str, ...], versions: dict[str, int]) -> tuple[int, str]:
    """How many tasks a worker may lease now in sync mode, and why not more."""
    buffers = state.buffers
    live = [p for p in training(state) if p in needed]
    if not live:
        return 0, "sync_done"
    if any(buffers[p].served for p in needed):
        return 0, "sync_training"
    if len({buffers[p].trainer_version for p in live}) > 1:
        return 0, "sync_barrier"
    if any(versions.get(p, -1) != buffers[p].trainer_version for p in needed):
        return 0, "stale_weights"
    group = state.cfg.tasks.group_size
    covered = len(state.tasks.leased) * group
    deficit = max(state.cfg.trainer_for(p).batch_size - _usable(state, p) - covered for p in live)
    return (math.ceil(deficit / group), "") if deficit > 0 else (0, "sync_full")


def sync_round_ready(state: "DataflowState", step: int) -> bool:
    """Whether every policy still training has its batch for this round (or took it already).
    A policy counts only once it has finished the round before: a verifier that asked for
    step 2 while the solver's step-1 batch still sat in the buffer was served it from its
    surplus, the versions parted, and no round could start again (a sync bench stalled)."""
    def ready(p: str) -> bool:
        buf = state.buffers[p]
        return (buf.trainer_step >= step or step in buf.served
                or (buf.trainer_step == step - 1 and _usable(state, p) >= state.cfg.trainer_for(p).batch_size))
    return all(ready(p) for p in training(state))


def _usable(state: "DataflowState", policy: str) -> int:
    buf = state.buffers[policy]
    return buf.available(buf.trainer_version)
