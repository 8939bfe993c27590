"""The request batching every engine shares: requests arriving in clumps a little apart run
as one batch when the engine may wait for them, and one that comes alone is not held back.

The model is replaced by a recorder of batch sizes (`generate_batch` is what the hf and vllm
engines implement; the batching in front of it is the code under test)."""
from __future__ import annotations

import asyncio
import time

import numpy as np

from astraflow.rollout.engines.base import Completion, SamplingParams
from astraflow.rollout.engines.batching import BatchingEngine


class RecordingEngine(BatchingEngine):
    def __init__(self, batch_wait_s: float, quiet_s: float = 0.1) -> None:
        # wide margins (clumps 10 ms apart, 100 ms of quiet): the test must hold on a busy machine
        super().__init__(max_batch=64, batch_wait_s=batch_wait_s, quiet_s=quiet_s)
        self.batches: list[int] = []

    def generate_batch(self, prompts, params):
        self.batches.append(len(prompts))
        time.sleep(0.01)  # a batch costs time, as a model's would
        return [Completion(np.array(p, np.int32), np.zeros(len(p), np.float32), self.version, True) for p in prompts]


async def clumps(engine: BatchingEngine, n: int, size: int, gap_s: float) -> list[Completion]:
    async def clump(i: int):
        await asyncio.sleep(i * gap_s)
        return await asyncio.gather(*(engine.generate([i, j], SamplingParams(2, 0.7)) for j in range(size)))

    out = await asyncio.gather(*(clump(i) for i in range(n)))
    return [c for group in out for c in group]


def test_clumps_a_little_apart_run_as_one_batch_when_the_engine_may_wait():
    waiting, eager = RecordingEngine(batch_wait_s=1.0), RecordingEngine(batch_wait_s=0.0)
    for engine in (waiting, eager):
        done = asyncio.run(clumps(engine, n=4, size=8, gap_s=0.01))
        assert sorted(tuple(c.tokens) for c in done) == sorted((i, j) for i in range(4) for j in range(8))
    assert waiting.batches == [32]
    assert len(eager.batches) > 1


def test_a_lone_request_is_not_held_for_the_whole_window():
    engine = RecordingEngine(batch_wait_s=5.0, quiet_s=0.01)

    async def one() -> float:
        t0 = time.perf_counter()
        await engine.generate([1, 2], SamplingParams(2, 0.7))
        return time.perf_counter() - t0

    assert asyncio.run(one()) < 2.0  # it starts once nothing more arrives for a moment
