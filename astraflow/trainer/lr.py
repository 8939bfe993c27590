"""The learning-rate schedule, a pure function of the step (so a resumed trainer continues it).

`constant`: `lr` at every step. `cosine`: a linear warm-up over `lr_warmup_steps`, then a
cosine decay from `lr` to `lr * lr_min_ratio` at the last step — a larger step size while the
policy is far from good, a smaller one near the end, where a constant rate made the reward
swing by about ±0.07 between 30-step windows.
"""
from __future__ import annotations

import math

from astraflow.config.schema import TrainerConfig


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """The rate for training step `step` (1-based)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step <= cfg.lr_warmup_steps:
        return cfg.lr * step / cfg.lr_warmup_steps
    span = max(1, cfg.steps - cfg.lr_warmup_steps)
    progress = min(1.0, (step - cfg.lr_warmup_steps) / span)
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
