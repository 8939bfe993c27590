"""Per-policy trajectory buffers and the served/consumed ledger.

A stored sample is in exactly one state: READY (in the buffer), FILTERED (zero advantage,
never served), SERVED (in a batch not yet acknowledged), CONSUMED (a trainer step
acknowledged it) or DROPPED (beyond the staleness bound when it came up for serving, or
stored after its trainer finished its steps: `unused`).

A policy whose trainer has finished exerts no backpressure: in co-training the other
policies' episodes still need its engine, and the run would otherwise stop leasing for good
once its buffer filled (observed: a solver starved at step 247 of 250 behind a finished
verifier's full buffer).

Served is not trained: `served[step]` is what a batch request for that step was given, and
`consumed[step]` what the trainer acknowledged (journalled). A batch request for a step
that was consumed before is a replay after a trainer restart and gets the same samples; one
for a step that was served but not consumed gets the same samples too (a retried request).
`ready(resume_step)` returns every served-but-unconsumed sample to the front of the buffer.

Batches take the oldest ready samples first (FIFO), or the newest (`serve_order: newest`):
where the trainer is the limit a standing queue forms, and FIFO serves every sample after it
has aged through that queue, at the staleness bound; newest-first serves the fresh ones and
drops the queue's old end as it goes stale.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

READY, FILTERED, SERVED, CONSUMED, DROPPED = range(5)
TOKEN_BYTES = 14  # a token's share of a TrajectoryBatch: token, logprob, mask, version, policy
STATE_NAMES = ("ready", "filtered", "served", "consumed", "dropped")


@dataclass
class SampleInfo:
    """What the buffer needs about a sample; the payload is kept only while it may be served."""
    sample_id: int
    task_id: int
    version_min: int
    advantage: float
    group_mean: float
    group_std: float
    loc: tuple[int, int]
    payload: Any = None  # (TrajectoryBatch, index) while READY/SERVED; else reread from the shard
    state: int = READY
    tokens: int = 0  # its length, for the memory held by cached payloads


@dataclass
class PolicyBuffer:
    name: str
    max_staleness: int
    capacity: int
    steps: int = 0  # the trainer's planned steps; 0: not known (never finished)
    newest_first: bool = False  # serve the last stored first (`serve_order: newest`)
    samples: dict[int, SampleInfo] = field(default_factory=dict)
    ready: deque[int] = field(default_factory=deque)
    served: dict[int, list[int]] = field(default_factory=dict)
    consumed: dict[int, list[int]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("stored", "guided", "served", "consumed", "dropped_stale", "filtered", "replayed", "unused"), 0))
    trainer_step: int = 0
    trainer_version: int = 0
    reward_sum: float = 0.0  # weighted, of every sample added since `generated_reward()` was last read
    reward_weight: float = 0.0
    reward_count: int = 0
    last_reward_mean: float = float("nan")  # NaN only until something is generated
    cached_tokens: int = 0  # tokens of the payloads held in memory

    def _release(self, info: SampleInfo, state: int) -> None:
        if info.payload is not None:
            self.cached_tokens -= info.tokens
        info.state, info.payload = state, None

    def add(self, info: SampleInfo, filtered: bool, reward: float, guided: bool = False, weight: float = 1.0) -> None:
        """Store a sample. A guided one (a reference answer, or a verdict on an answer the
        solver did not give) is trained like any other but counted apart, and never in the
        generated reward. `weight`: its prompt's in the generated reward (selection.py)."""
        self.samples[info.sample_id] = info
        self.counts["stored"] += 1
        if guided:
            self.counts["guided"] += 1
        else:
            self.reward_sum += weight * reward
            self.reward_weight += weight
            self.reward_count += 1
        if info.payload is not None:
            self.cached_tokens += info.tokens
        if filtered:
            self._release(info, FILTERED)
            self.counts["filtered"] += 1
        elif self.finished:
            self._release(info, DROPPED)
            self.counts["unused"] += 1
        else:
            self.ready.append(info.sample_id)

    @property
    def buffered(self) -> int:
        return len(self.ready)

    def available(self, trainer_version: int) -> int:
        """Ready samples that the next `take` would not drop as stale."""
        floor = trainer_version - self.max_staleness
        return sum(1 for sid in self.ready if self.samples[sid].state == READY
                   and self.samples[sid].version_min >= floor)

    @property
    def finished(self) -> bool:
        return 0 < self.steps <= self.trainer_step

    def has_room(self, expected: int) -> bool:
        return self.finished or len(self.ready) + expected <= self.capacity

    def take(self, step: int, n: int, trainer_version: int) -> list[int] | None:
        """Fresh samples for a new step, or None if fewer than n are ready (caller waits).
        Oldest first, or newest first: then the old end, where stale samples collect, is
        cleared first (else they would hold the buffer's room until it filled)."""
        floor = trainer_version - self.max_staleness
        if self.newest_first:
            while self.ready and self._dropped_if_stale(self.ready[0], floor):
                self.ready.popleft()
        pop = self.ready.pop if self.newest_first else self.ready.popleft
        picked: list[int] = []
        while self.ready and len(picked) < n:
            sid = pop()
            if not self._dropped_if_stale(sid, floor):
                picked.append(sid)
        if len(picked) < n:
            for sid in reversed(picked):
                self._put_first(sid)
            return None
        for sid in picked:
            self.samples[sid].state = SERVED
        self.served[step] = picked
        self.counts["served"] += len(picked)
        return picked

    def _dropped_if_stale(self, sid: int, floor: int) -> bool:
        """Drop a ready sample older than `floor`; True if it is not (or no longer) ready."""
        info = self.samples[sid]
        if info.state == READY and info.version_min < floor:
            self._release(info, DROPPED)
            self.counts["dropped_stale"] += 1
        return info.state != READY

    def _put_first(self, sid: int) -> None:
        """Back to the end that `take` serves from next."""
        if self.newest_first:
            self.ready.append(sid)
        else:
            self.ready.appendleft(sid)

    def consume(self, step: int, ids: list[int]) -> str | None:
        """Record a trainer step's acknowledgement; returns an error text if it does not fit.
        Only a served step (or a consumed one, acknowledged again) with exactly its ids fits:
        an acknowledgement of a step never served would otherwise move `trainer_step`, and
        a step far ahead marked the trainer finished for good."""
        expected = self.served.get(step)
        if expected is None:
            expected = self.consumed.get(step)
        if expected is None:
            return f"step {step} was never served"
        if sorted(expected) != sorted(ids):
            return f"step {step} was served {len(expected)} other samples"
        for sid in ids:
            info = self.samples[sid]
            if info.state != CONSUMED:
                self.counts["consumed"] += 1
            self._release(info, CONSUMED)
        self.served.pop(step, None)
        self.consumed[step] = list(ids)
        self.trainer_step = max(self.trainer_step, step)
        return None

    def trainer_restarted(self, resume_step: int) -> list[int]:
        """Return unacknowledged samples to the buffer; list the steps that will be replayed."""
        for step in sorted(self.served, reverse=True):
            for sid in reversed(self.served[step]):
                info = self.samples[sid]
                if info.state == SERVED:
                    info.state = READY
                    self._put_first(sid)
        self.served.clear()
        self.trainer_step = resume_step
        return sorted(s for s in self.consumed if s > resume_step)

    def generated_reward(self) -> tuple[float, int]:
        """Mean reward (weighted by prompt selection) and count of everything generated since
        the last call (then reset).
        With nothing generated since, the previous mean and a count of 0: a trainer step
        served from the buffer's surplus still has a defined reward in the metrics (it was
        NaN, which broke moving averages over the CSV)."""
        if self.reward_count:
            self.last_reward_mean = self.reward_sum / self.reward_weight
        out = (self.last_reward_mean, self.reward_count)
        self.reward_sum, self.reward_weight, self.reward_count = 0.0, 0.0, 0
        return out

    def state_counts(self) -> dict[str, int]:
        states = np.fromiter((i.state for i in self.samples.values()), dtype=np.int8, count=len(self.samples))
        return {STATE_NAMES[s]: int((states == s).sum()) for s in range(len(STATE_NAMES))}


def cached_mb(buffers: Iterable["PolicyBuffer"]) -> float:
    """Memory held by the payloads the buffers keep (about)."""
    return sum(b.cached_tokens for b in buffers) * TOKEN_BYTES / (1 << 20)


def group_stats(rewards: np.ndarray, scale: bool = True) -> tuple[float, float, np.ndarray]:
    """GRPO group normalisation: mean, std and per-sample advantages (r - mean) / (std + eps),
    or r - mean without `scale`."""
    mean = float(rewards.mean())
    std = float(rewards.std())
    return mean, std, (rewards - mean) / (std + 1e-6 if scale else 1.0)
