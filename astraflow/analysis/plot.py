"""`astraflow plot RUN_DIR [-o PNG]`: the training curve of a run, from its own metrics.

Per policy: the reward of everything generated (what the policy achieves) and of the trained
batches, against wall-clock seconds since the first step, with the held-out accuracy of the
starting and final weights (from `eval.json`) as horizontal markers. One point per step (a
step replayed after a trainer restart is drawn once, `read_metrics`). The generated reward is
drawn as a moving average over the last `SMOOTH_STEPS` steps that generated samples, weighted
by each step's sample count: a step served from the buffer's surplus may have seen a single
new group, and its own mean (drawn faintly) swings from 0 to 1.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import yaml

from astraflow.analysis.metrics import SMOOTH_STEPS, generated_reward_smoothed, read_metrics
from astraflow.config.rundir import existing_run

DEFAULT_NAME = "curve.png"  # inside the run directory: a plot never overwrites another run's


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curve to `out` (default: RUN_DIR/curve.png); returns where."""
    run_dir = existing_run(run_dir)
    out = Path(out) if out is not None else run_dir / DEFAULT_NAME
    save_curve(run_dir, out)
    return out


def save_curve(run_dir: Path, out: str | Path | BinaryIO) -> None:
    """Draw the curve into `out`: a path or a binary file (the HTML report inlines it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in sorted((run_dir / "metrics").glob("*.csv")):
        rows = read_metrics(run_dir, path.stem)
        if not rows:
            continue
        t = [r["time"] - rows[0]["time"] for r in rows]
        line, = ax.plot(t, generated_reward_smoothed(rows),
                        label=f"{path.stem}: reward (generated, {SMOOTH_STEPS}-step mean)")
        ax.plot(t, [r["reward_mean"] for r in rows], lw=0.5, alpha=0.3, c=line.get_color())
        ax.plot(t, [r["reward_trained"] for r in rows], alpha=0.4, label=f"{path.stem}: reward (trained batch)")
    evals = run_dir / "eval.json"
    if evals.exists():
        e = json.loads(evals.read_text())  # no accuracies when there were no held-out prompts (`eval_skipped`)
        if "eval_accuracy_base" in e:
            base = e["eval_accuracy_base"]
            ax.axhline(base, ls=":", c="gray", label=f"held-out, start: {base:.2f}")
        if "eval_accuracy" in e:
            ax.axhline(e["eval_accuracy"], ls="--", c="black", label=f"held-out, end: {e['eval_accuracy']:.2f}")
    ax.set_xlabel("seconds since the first training step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1.02)  # a held-out accuracy of 1.0 stays visible
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to label before the first step
        ax.legend(fontsize=8, loc="upper left")
    name = yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["name"]
    ax.set_title(f"{name}: {run_dir.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
