"""Held-out evaluation through the engine, greedy, of each policy's starting and last weights.

What is measured depends on the policy's role: a solver (or the single `policy` of rlvr) is
scored by accuracy on the held-out prompts; a verifier by balanced accuracy on those prompts
each paired with the right answer and with a wrong one (so always-accept and always-reject
both score 0.5). An agent (multi_turn_tool) needs its environment and tools and is not
evaluated here; its training reward is in the metrics.

`eval.json`: `eval[policy] = {metric, base, last, version}`, and for the first policy the
flat keys `eval_accuracy_base`, `eval_accuracy`, `eval_version` that summaries and plots read.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from astraflow.config.rundir import RunDir
from astraflow.config.schema import Config
from astraflow.models import policy_model_dir
from astraflow.rollout.engines import ENGINES
from astraflow.rollout.engines.base import Engine, SamplingParams
from astraflow.tasks.sources import Item, TaskSource
from astraflow.workflows.cotrain import accepted, judge_context, wrong_answer
from astraflow.workflows.rewards import REWARDS

METRICS = {"policy": "accuracy", "solver": "accuracy", "verifier": "balanced_accuracy"}


async def _greedy(engine: Engine, contexts: list[list[int]], max_tokens: int) -> list[str]:
    params = SamplingParams(max_tokens, temperature=0.0)
    outs = await asyncio.gather(*(engine.generate(c, params) for c in contexts))
    return [engine.codec.decode(o.tokens) for o in outs]


async def _accuracy(engine: Engine, items: list[Item], cfg: Config) -> float:
    reward = REWARDS[cfg.tasks.reward]
    texts = await _greedy(engine, [engine.codec.encode_prompt(i.prompt) for i in items], cfg.engine.max_tokens)
    return sum(reward(t, i.answer) for t, i in zip(texts, items)) / len(items)


async def _balanced_accuracy(engine: Engine, items: list[Item], cfg: Config) -> float:
    codec, rng = engine.codec, np.random.default_rng(cfg.run.seed)
    cases = [(c, truth) for i in items for c, truth in ((i.answer, True), (wrong_answer(i, rng), False))]
    contexts = [judge_context(codec, codec.encode_prompt(i.prompt), codec.encode_completion(c))
                for i, (c, _) in zip([i for i in items for _ in (0, 1)], cases)]
    verdicts = [accepted(t) for t in await _greedy(engine, contexts, cfg.engine.max_tokens)]
    truths = np.array([t for _, t in cases])
    accept = np.array(verdicts)
    return float(((accept & truths).sum() / truths.sum() + (~accept & ~truths).sum() / (~truths).sum()) / 2)


def evaluate(model_dir: Path, weights_dir: Path | None, cfg: Config, metric: str = "accuracy") -> float:
    engine = ENGINES[cfg.engine.kind](str(model_dir), max_batch=cfg.engine.max_batch,
                                       threads=cfg.engine.threads, seed=cfg.run.seed)
    items = TaskSource(cfg.tasks).heldout
    score = _accuracy if metric == "accuracy" else _balanced_accuracy

    async def run() -> float:
        if weights_dir is not None:
            await engine.load_weights(weights_dir, version=-1)
        return await score(engine, items, cfg)

    try:
        return asyncio.run(run())
    finally:
        engine.close()


def evaluate_run(run: RunDir) -> dict:
    cfg, out = run.config, {"eval": {}}
    for policy in cfg.policies:
        metric = METRICS.get(policy.role)
        if metric is None:
            continue
        model_dir = policy_model_dir(run.path, cfg, policy.name)
        result = {"metric": metric, "base": evaluate(model_dir, None, cfg, metric)}
        versions = sorted((run.path / "weights" / policy.name).glob("v*"), key=lambda p: int(p.name[1:]))
        if versions:
            result.update(last=evaluate(model_dir, versions[-1], cfg, metric), version=int(versions[-1].name[1:]))
        out["eval"][policy.name] = result
    first = out["eval"].get(cfg.policies[0].name)
    if first:
        out["eval_accuracy_base"] = first["base"]
        if "last" in first:
            out.update(eval_accuracy=first["last"], eval_version=first["version"])
    return out
