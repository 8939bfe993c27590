"""Reading a trainer's per-step metrics (`RUN_DIR/metrics/<policy>.csv`), shared by the
progress line, the run summary and the plot. Only complete lines are returned: the trainer
may be writing the last one while it is read.

A row's `reward_mean` is the mean over the `generated` samples that arrived since the trainer's
previous step, anywhere from one group (a step served from the buffer's surplus) to several
batches; means over steps therefore weigh each step by that count (`generated_reward`)."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

SMOOTH_STEPS = 5


def read_metrics(run_dir: str | Path, policy: str) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics" / f"{policy}.csv"
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (FileNotFoundError, csv.Error):
        return []
    out = []
    for row in rows:
        try:
            out.append({k: float(v) for k, v in row.items()})
        except (TypeError, ValueError):  # a line cut short
            continue
    return out


def _weighted_rewards(rows: list[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Per step: reward times sample count, and the count (a carried-over NaN weighs nothing)."""
    count = np.array([r["generated"] for r in rows], dtype=float)
    return np.nan_to_num([r["reward_mean"] for r in rows]) * count, count


def generated_reward(rows: list[dict[str, float]]) -> float:
    """Mean reward of everything generated over these steps (NaN if nothing was)."""
    reward, count = _weighted_rewards(rows)
    return float(reward.sum() / count.sum()) if count.sum() else float("nan")


def generated_reward_smoothed(rows: list[dict[str, float]], steps: int = SMOOTH_STEPS) -> np.ndarray:
    """Per step, the mean reward of the samples generated over the last `steps` steps (NaN
    until something was)."""
    reward, count = _weighted_rewards(rows)
    kernel = np.ones(steps)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.convolve(reward, kernel)[:len(rows)] / np.convolve(count, kernel)[:len(rows)]
