"""A trainer's per-step metrics (`RUN_DIR/metrics/<policy>.csv`): the trainer's writer and the
reader shared by the progress line, the run summary, the benches and the plot.

The file is append-only: a killed trainer leaves at most a torn last line, which the next
append cuts off first (else the restarted trainer's first row would be glued onto it, and a
torn step number could read as another step). A restarted trainer appends a row again for
every step it replays, so a step may have several rows. `read_metrics` returns one row per
step, in step order, merged: the training columns of the step's last row (that training is the
one in the run's lineage; an earlier one was undone by resuming from a checkpoint), and the
generation columns (`generated`, `reward_mean`) of all of them together (a row reports the
samples generated since the previous batch was served; those happened once, whichever
training of the step wrote them, and a replayed step's row reports 0). Summing `samples` over
the merged rows therefore counts each trained step once.

A row's `reward_mean` is the mean over the `generated` samples that arrived since the
trainer's previous step, anywhere from none (a replayed step, or one served from the buffer's
surplus) to several batches. Reward windows therefore weigh each step by that count and count
only steps that generated something: "the last k steps" of a reward means the last k steps
with `generated` > 0 (`generating_window`), so a window is empty only when the run generated
nothing at all."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

SMOOTH_STEPS = 5
GENERATION = ("generated", "reward_mean")  # merged over a step's rows; the other columns: its last row


def metrics_path(run_dir: str | Path, policy: str) -> Path:
    return Path(run_dir) / "metrics" / f"{policy}.csv"


def append_metrics(path: Path, fields: tuple[str, ...], row: dict) -> None:
    """Append one row (the header first in a new or empty file), cutting off a torn last line."""
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.seek(0)
                data = f.read()
                size = data.rfind(b"\n") + 1  # 0: even the header was cut short
                f.truncate(size)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fields)
        if not size:
            writer.writeheader()
        writer.writerow(row)


def read_rows(path: Path) -> list[dict[str, float]]:
    """Every complete row of the file as written (a step may repeat); a torn line is skipped."""
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


def merge_steps(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """One row per step, in step order (see the module docstring for the rule)."""
    by_step: dict[int, list[dict[str, float]]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), []).append(row)
    out = []
    for step in sorted(by_step):
        written = by_step[step]
        merged = dict(written[-1])
        count = sum(r["generated"] for r in written)
        if count:
            merged["reward_mean"] = sum(np.nan_to_num(r["reward_mean"]) * r["generated"] for r in written) / count
        merged["generated"] = count
        out.append(merged)
    return out


def read_metrics(run_dir: str | Path, policy: str) -> list[dict[str, float]]:
    """The policy's metrics, one merged row per step, in step order."""
    return merge_steps(read_rows(metrics_path(run_dir, policy)))


def _weighted_rewards(rows: list[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Per step: reward times sample count, and the count (a carried-over NaN weighs nothing)."""
    count = np.array([r["generated"] for r in rows], dtype=float)
    return np.nan_to_num([r["reward_mean"] for r in rows]) * count, count


def generated_reward(rows: list[dict[str, float]]) -> float:
    """Mean reward of everything generated over these steps (NaN if nothing was)."""
    reward, count = _weighted_rewards(rows)
    return float(reward.sum() / count.sum()) if count.sum() else float("nan")


def generating_window(rows: list[dict[str, float]], k: int, last: bool = True) -> list[dict[str, float]]:
    """The last (or first) `k` steps that generated samples; empty only if none did."""
    generating = [r for r in rows if r["generated"] > 0]
    return generating[-k:] if last else generating[:k]


def generated_reward_smoothed(rows: list[dict[str, float]], steps: int = SMOOTH_STEPS) -> np.ndarray:
    """Per step, the mean reward of the samples generated over the last `steps` steps that
    generated any (NaN until one did): a step that generated nothing keeps the value before it."""
    reward, count = _weighted_rewards(rows)
    out = np.full(len(rows), np.nan)
    at = np.flatnonzero(count > 0)
    if not len(at):
        return out
    kernel = np.ones(steps)
    out[at] = np.convolve(reward[at], kernel)[:len(at)] / np.convolve(count[at], kernel)[:len(at)]
    held = np.maximum.accumulate(np.where(count > 0, np.arange(len(rows)), -1))  # the last generating step so far
    return np.where(held >= 0, out[np.maximum(held, 0)], np.nan)
