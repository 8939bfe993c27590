"""Pre-rollout selection: skip prompts that recently taught nothing (GRESO, arXiv 2506.02177).

A group whose rewards are all equal has zero advantage and is filtered after it was
generated; late in a run most groups are (all right), and generating them is most of the
engine's work. A prompt's value is consistent over time, so a prompt whose last `z` groups
were all filtered is leased with probability `explore ** min(z, max_streak)` and skipped
otherwise; one informative group resets `z`. `max_streak` bounds both how rarely a solved
prompt is revisited (a policy that forgets it is noticed) and the weight below.

The training reward must stay the reward of the task distribution, not of the prompts that
were kept: every kept prompt carries the weight `1 / p` of its selection probability, and
the generated reward is the weighted mean (a Horvitz-Thompson estimate, unbiased for the
mean over uniformly drawn prompts).

Invariants: selection only ever skips a task that nobody holds (no generated sample is
dropped by it); a skipped task id is spent (it counts toward `tasks.max_tasks`) until a
restarted dataflow rank offers it again; the history is rebuilt from the shards then.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Callable

from astraflow.config.schema import SelectionConfig


class PromptSelection:
    """Switched off (`skip_zero_advantage: false`) it keeps every task at weight 1 and
    remembers nothing."""

    def __init__(self, cfg: SelectionConfig, seed: int, prompt_of: Callable[[int], int]) -> None:
        self.cfg = cfg
        self.on = cfg.skip_zero_advantage
        self.prompt_of = prompt_of  # task id -> prompt index
        self.rng = random.Random(seed)
        self.streak: Counter[int] = Counter()  # prompt index -> zero-advantage groups in a row
        self.weights: dict[int, float] = {}  # kept task -> 1 / its selection probability, until committed
        self.skipped = 0

    def keep(self, task_id: int) -> bool:
        """Whether to hand this task out now (its weight is remembered) or skip it."""
        if not self.on:
            return True
        p = self.cfg.explore ** min(self.streak[self.prompt_of(task_id)], self.cfg.max_streak)
        if p < 1.0 and self.rng.random() >= p:
            self.skipped += 1
            self.weights.pop(task_id, None)  # a handed-back task, kept once before
            return False
        self.weights[task_id] = 1.0 / p  # kept past an expired lease: a late commit still counts so
        return True

    def weight(self, task_id: int) -> float:
        """The weight of a committed task's rewards (1: kept before the rank restarted)."""
        return self.weights.get(task_id, 1.0)

    def observe(self, task_id: int, zero_advantage: bool) -> None:
        """A committed task: whether every group it produced was filtered."""
        if not self.on:
            return
        self.weights.pop(task_id, None)
        prompt = self.prompt_of(task_id)
        if zero_advantage:
            self.streak[prompt] += 1
        else:
            self.streak.pop(prompt, None)
