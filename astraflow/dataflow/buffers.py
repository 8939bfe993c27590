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

from astraflow.dataflow.samples import SampleTable

READY, FILTERED, SERVED, CONSUMED, DROPPED = range(5)
TOKEN_BYTES = 14  # a token's share of a TrajectoryBatch: token, logprob, mask, version, policy
STATE_NAMES = ("ready", "filtered", "served", "consumed", "dropped")


@dataclass
class PolicyBuffer:
    """One policy's buffer over the run's `SampleTable` (shared by every policy's buffer; this
    one's samples are those with `policy == index`). `payloads` holds the trajectories of
    the samples cached in memory, only while they may be served (READY or SERVED)."""
    name: str
    max_staleness: int
    capacity: int
    steps: int = 0  # the trainer's planned steps; 0: not known (never finished)
    newest_first: bool = False  # serve the last stored first (`serve_order: newest`)
    index: int = 0  # this policy's index in the table's `policy` column
    samples: SampleTable = field(default_factory=SampleTable)
    payloads: dict[int, Any] = field(default_factory=dict)  # id -> (TrajectoryBatch, index)
    ready: deque[int] = field(default_factory=deque)
    served: dict[int, np.ndarray] = field(default_factory=dict)  # step -> ids (int64)
    consumed: dict[int, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("stored", "guided", "served", "consumed", "dropped_stale", "filtered", "replayed", "unused"), 0))
    trainer_step: int = 0
    trainer_version: int = 0
    reward_sum: float = 0.0  # weighted, of every sample added since `generated_reward()` was last read
    reward_weight: float = 0.0
    reward_count: int = 0
    last_reward_mean: float = float("nan")  # NaN only until something is generated
    cached_tokens: int = 0  # tokens of the payloads held in memory

    def _release(self, ids: Iterable[int], state: int) -> None:
        """Move `ids` to `state`, letting go of their cached payloads."""
        for sid in ids:
            if self.payloads.pop(sid, None) is not None:
                self.cached_tokens -= int(self.samples.tokens[sid])
            self.samples.state[sid] = state

    def add(self, ids: np.ndarray, filtered: bool, rewards: np.ndarray, guided: np.ndarray | None = None,
            weight: float = 1.0, payloads: list[Any] | None = None) -> None:
        """Store one group's samples, whose columns are in the table already. A guided one (a
        reference answer, or a verdict on an answer the solver did not give) is trained like
        any other but counted apart, and never in the generated reward. `weight`: its
        prompt's in the generated reward (selection.py)."""
        guided = np.zeros(len(ids), bool) if guided is None else np.asarray(guided, bool)
        self.counts["stored"] += len(ids)
        self.counts["guided"] += int(guided.sum())
        own = np.asarray(rewards, np.float64)[~guided]
        self.reward_sum += weight * float(own.sum())
        self.reward_weight += weight * len(own)
        self.reward_count += len(own)
        ids = [int(sid) for sid in ids]
        self.samples.state[ids] = READY
        if filtered or self.finished:
            self._release(ids, FILTERED if filtered else DROPPED)
            self.counts["filtered" if filtered else "unused"] += len(ids)
            return
        if payloads is not None:
            for sid, payload in zip(ids, payloads):
                self.payloads[sid] = payload
                self.cached_tokens += int(self.samples.tokens[sid])
        self.ready.extend(ids)

    def restore(self) -> None:
        """After recovery wrote every state into the table: the counts and the ready queue
        (`served` counts servings, from the journal's `served` events)."""
        ids = self.samples.ids_of(self.index)
        states = self.samples.state[ids]
        self.counts["stored"] += len(ids)
        for state, name in ((FILTERED, "filtered"), (CONSUMED, "consumed")):
            self.counts[name] += int((states == state).sum())
        self.ready.extend(ids[states == READY].tolist())

    @property
    def buffered(self) -> int:
        return len(self.ready)

    def available(self, trainer_version: int) -> int:
        """Ready samples that the next `take` would not drop as stale."""
        ids = np.fromiter(self.ready, np.int64, len(self.ready))
        floor = trainer_version - self.max_staleness
        return int(((self.samples.state[ids] == READY) & (self.samples.version_min[ids] >= floor)).sum())

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
        self.samples.state[picked] = SERVED
        self.served[step] = np.array(picked, np.int64)
        self.counts["served"] += len(picked)
        return picked

    def _dropped_if_stale(self, sid: int, floor: int) -> bool:
        """Drop a ready sample older than `floor`; True if it is not (or no longer) ready."""
        if self.samples.state[sid] == READY and self.samples.version_min[sid] < floor:
            self._release((sid,), DROPPED)
            self.counts["dropped_stale"] += 1
        return self.samples.state[sid] != READY

    def _put_first(self, sid: int) -> None:
        """Back to the end that `take` serves from next."""
        if self.newest_first:
            self.ready.append(sid)
        else:
            self.ready.appendleft(sid)

    def step_ids(self, step: int) -> np.ndarray | None:
        """The ids a batch request for `step` gets again: consumed (a replay) or served (a retry)."""
        ids = self.consumed.get(step)
        return self.served.get(step) if ids is None else ids

    def consume(self, step: int, ids: list[int]) -> str | None:
        """Record a trainer step's acknowledgement; returns an error text if it does not fit.
        Only a served step (or a consumed one, acknowledged again) with exactly its ids fits:
        an acknowledgement of a step never served would otherwise move `trainer_step`, and
        a step far ahead marked the trainer finished for good."""
        expected = self.step_ids(step)
        if expected is None:
            return f"step {step} was never served"
        acknowledged = np.asarray(ids, np.int64)
        if not np.array_equal(np.sort(expected), np.sort(acknowledged)):
            return f"step {step} was served {len(expected)} other samples"
        self.counts["consumed"] += int((self.samples.state[acknowledged] != CONSUMED).sum())
        self._release(acknowledged.tolist(), CONSUMED)
        self.served.pop(step, None)
        self.consumed[step] = acknowledged
        self.trainer_step = max(self.trainer_step, step)
        return None

    def trainer_restarted(self, resume_step: int) -> list[int]:
        """Return unacknowledged samples to the buffer; list the steps that will be replayed."""
        for step in sorted(self.served, reverse=True):
            for sid in reversed(self.served[step].tolist()):
                if self.samples.state[sid] == SERVED:
                    self.samples.state[sid] = READY
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

def cached_mb(buffers: Iterable["PolicyBuffer"]) -> float:
    """Memory held by the payloads the buffers keep (about)."""
    return sum(b.cached_tokens for b in buffers) * TOKEN_BYTES / (1 << 20)


def grouped_stats(rewards: np.ndarray, starts: np.ndarray, scale: np.ndarray | bool = True
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GRPO group normalisation of many groups at once: `rewards` sorted by group, each group
    starting at `starts`. Per group mean and std, per sample the advantage (r - mean) /
    (std + eps), or r - mean where `scale` (per group, or for all) is false. The commit path
    and recovery both compute advantages here, so a restarted rank serves the same ones."""
    rewards = np.asarray(rewards, np.float64)
    counts = np.diff(np.append(starts, len(rewards)))
    mean = np.add.reduceat(rewards, starts) / counts
    dev = rewards - np.repeat(mean, counts)
    std = np.sqrt(np.add.reduceat(dev * dev, starts) / counts)
    denominator = np.where(scale, std + 1e-6, 1.0)
    return mean, std, dev / np.repeat(denominator, counts)


def group_stats(rewards: np.ndarray, scale: bool = True) -> tuple[float, float, np.ndarray]:
    """One group's mean, std and advantages (`grouped_stats`)."""
    mean, std, adv = grouped_stats(rewards, np.zeros(1, np.int64), scale)
    return float(mean[0]), float(std[0]), adv
