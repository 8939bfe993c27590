"""Held-out evaluation through the engine, greedy, of each policy's starting and last weights.

What is measured depends on the policy's role: a solver (or the single `policy` of rlvr) is
scored by accuracy on the held-out prompts; a verifier by balanced accuracy on those prompts
each paired with the right answer and with a wrong one (so always-accept and always-reject
both score 0.5); a search agent by its mean reward over greedy episodes of the run's own
workflow, one per held-out prompt, with the same corpus and no reference guidance
(`episode_reward`). A tool agent (multi_turn_tool) needs its environment server and is not
evaluated here; its training reward is in the metrics.

One engine per policy scores both: the starting weights first, then the last published
version loaded into it. The local launcher starts the evaluation with the components
(`--after-stdin`, nice 19): it imports the engine's library (vLLM: ~7 s of CPU) during the
run's start-up and builds its engines when training ends: built during the run, at nice 19,
its engine slowed the first trainer steps to twice their time for 10-20 s.

`eval.json`: `eval[policy] = {metric, base, last, version}`, and for the first policy the
flat keys `eval_accuracy_base`, `eval_accuracy`, `eval_version` that summaries and plots read.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

import numpy as np

from astraflow.config.rundir import RunDir
from astraflow.config.schema import Config
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.rollout.engines import import_library
from astraflow.rollout.engines.base import Engine
from astraflow.rollout.worker import build_engines, episode_context, run_tokenizer, sampling_params
from astraflow.protocol.messages import Task
from astraflow.weights.manifest import newest_dir
from astraflow.tasks.sources import Item, TaskSource
from astraflow.workflows import WORKFLOWS
from astraflow.workflows.cotrain import accepted, judge_context, wrong_answer
from astraflow.workflows.rewards import Scorer

METRICS = {"policy": "accuracy", "solver": "accuracy", "verifier": "balanced_accuracy"}
EPISODE_WORKFLOWS = ("search",)  # their policies are evaluated by whole greedy episodes


async def _greedy(engine: Engine, tokenizer: ModelTokenizer, contexts: list[list[int]], cfg: Config) -> list[str]:
    params = sampling_params(cfg, tokenizer, temperature=0.0)
    outs = await asyncio.gather(*(engine.generate(c, params) for c in contexts))
    return [tokenizer.decode(o.tokens) for o in outs]


async def _accuracy(engine: Engine, tokenizer: ModelTokenizer, items: list[Item], cfg: Config) -> float:
    score = Scorer(cfg.tasks.reward, cfg.tasks.reward_timeout_s)
    texts = await _greedy(engine, tokenizer, [tokenizer.encode_prompt(i.prompt, i.messages) for i in items], cfg)
    rewards = await asyncio.gather(*(score(t, i.answer, i.row) for t, i in zip(texts, items)))
    return sum(rewards) / len(items)


async def _balanced_accuracy(engine: Engine, tokenizer: ModelTokenizer, items: list[Item], cfg: Config) -> float:
    rng = np.random.default_rng(cfg.run.seed)
    cases = [(c, truth) for i in items for c, truth in ((i.answer, True), (wrong_answer(i, rng), False))]
    contexts = [judge_context(tokenizer, tokenizer.encode_prompt(i.prompt, i.messages), tokenizer.encode_completion(c))
                for i, (c, _) in zip([i for i in items for _ in (0, 1)], cases)]
    verdicts = [accepted(t) for t in await _greedy(engine, tokenizer, contexts, cfg)]
    truths = np.array([t for _, t in cases])
    accept = np.array(verdicts)
    return float(((accept & truths).sum() / truths.sum() + (~accept & ~truths).sum() / (~truths).sum()) / 2)


async def _episode_reward(engine: Engine, tokenizer: ModelTokenizer, items: list[Item], cfg: Config) -> float:
    ctx = episode_context(cfg, {p: engine for p in cfg.policy_names}, tokenizer, np.random.default_rng(cfg.run.seed),
                          temperature=0.0)
    ctx.workflow = dataclasses.replace(cfg.workflow, reference_guidance=False)
    run = WORKFLOWS[cfg.tasks.workflow].run
    tasks = [Task(i, 0.0, item.prompt, item.answer, 1, cfg.policy_names, messages=list(item.messages),
                  solution=item.solution, row=item.row) for i, item in enumerate(items)]
    groups = await asyncio.gather(*(run(task, ctx) for task in tasks))
    return sum(g[0].reward for g in groups) / len(items)


SCORERS = {"accuracy": _accuracy, "balanced_accuracy": _balanced_accuracy, "episode_reward": _episode_reward}


def metric_of(cfg: Config, role: str) -> str | None:
    if cfg.tasks.workflow in EPISODE_WORKFLOWS:
        return "episode_reward"
    return METRICS.get(role)


def evaluate_run(run: RunDir, training_done: Callable[[], None] = lambda: None) -> dict:
    """Import the engine's library, wait for `training_done()` to return, then score each
    policy's starting weights and the last published version, loaded into the same engine."""
    cfg = run.config
    items = TaskSource(cfg.tasks).heldout
    if not items:
        training_done()
        return {"eval": {}, "eval_skipped": "tasks.heldout is 0: no held-out prompts to evaluate on"}
    metrics = {p.name: metric for p in cfg.policies if (metric := metric_of(cfg, p.role))}
    import_library(cfg.engine)
    training_done()
    engines = build_engines(run, list(metrics))
    from astraflow.weights.reader import load_version  # torch: only after the engine's library set its threads
    tokenizer = run_tokenizer(run)

    async def score(name: str, weights: dict | None = None) -> float:
        if weights is not None:
            await engines[name].load_state(weights, version=-1)
        return await SCORERS[metrics[name]](engines[name], tokenizer, items, cfg)

    out: dict = {"eval": {}}
    try:
        for name, metric in metrics.items():
            out["eval"][name] = {"metric": metric, "base": asyncio.run(score(name))}
        for name in metrics:
            if newest_dir(run.path / "weights" / name) is not None:
                weights, manifest = load_version(run.path / "weights", name)  # materialised from its deltas
                last = asyncio.run(score(name, weights))
                out["eval"][name].update(last=last, version=manifest.version)
    finally:
        for engine in engines.values():
            engine.close()
    first = out["eval"].get(cfg.policies[0].name)
    if first:
        out["eval_accuracy_base"] = first["base"]
        if "last" in first:
            out.update(eval_accuracy=first["last"], eval_version=first["version"])
    return out
