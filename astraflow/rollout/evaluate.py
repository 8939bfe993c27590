"""Greedy accuracy on the held-out prompts, generated through the engine with given weights."""
from __future__ import annotations

import asyncio
from pathlib import Path

from astraflow.config.schema import Config
from astraflow.rollout.engines import ENGINES
from astraflow.rollout.engines.base import SamplingParams
from astraflow.tasks.sources import TaskSource
from astraflow.workflows.rewards import REWARDS


def evaluate(base_model_dir: Path, weights_dir: Path | None, cfg: Config) -> float:
    engine = ENGINES[cfg.engine.kind](str(base_model_dir), max_batch=cfg.engine.max_batch,
                                       threads=cfg.engine.threads, seed=cfg.run.seed)
    items = TaskSource(cfg.tasks).heldout
    reward = REWARDS[cfg.tasks.reward]
    params = SamplingParams(cfg.engine.max_tokens, temperature=0.0)

    async def score() -> float:
        if weights_dir is not None:
            await engine.load_weights(weights_dir, version=-1)
        outs = await asyncio.gather(*(engine.generate(engine.codec.encode_prompt(i.prompt), params) for i in items))
        return sum(reward(engine.codec.decode(o.tokens), i.answer) for o, i in zip(outs, items)) / len(items)

    try:
        return asyncio.run(score())
    finally:
        engine.close()


