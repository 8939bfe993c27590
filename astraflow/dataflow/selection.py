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

from astraflow.config.schema import SelectionConfig


class PromptSelection:
    def __init__(self, cfg: SelectionConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.streak: Counter[int] = Counter()  # prompt index -> zero-advantage groups in a row
        self.skipped = 0

    def weight(self, prompt: int) -> float | None:
        """None: skip this prompt now; else the weight of its rewards (1 / its selection probability)."""
        if not self.cfg.skip_zero_advantage:
            return 1.0
        p = self.cfg.explore ** min(self.streak[prompt], self.cfg.max_streak)
        if p < 1.0 and self.rng.random() >= p:
            self.skipped += 1
            return None
        return 1.0 / p

    def observe(self, prompt: int, zero_advantage: bool) -> None:
        """A committed task: whether every group it produced was filtered."""
        if zero_advantage:
            self.streak[prompt] += 1
        else:
            self.streak.pop(prompt, None)
