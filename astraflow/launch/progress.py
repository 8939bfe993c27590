"""The live progress line of `astraflow run`: step, reward (of the samples generated over the
last few steps that generated any, as in the plot and the summary), tokens/s, staleness per
policy.

Reads the trainers' metrics CSVs (the launcher never talks to trainers directly)."""
from __future__ import annotations

import sys
import time

from astraflow.analysis.metrics import generated_reward_smoothed, read_metrics
from astraflow.config.rundir import RunDir


class Progress:
    def __init__(self, run: RunDir, quiet: bool) -> None:
        self.run, self.quiet = run, quiet or not sys.stderr.isatty()
        self.t0 = time.time()
        self.last_print = 0.0

    def update(self) -> None:
        now = time.time()
        if now - self.last_print < (1.0 if not self.quiet else 10.0):
            return
        self.last_print = now
        parts = []
        for p in self.run.config.policy_names:
            rows = read_metrics(self.run.path, p)
            if not rows:
                parts.append(f"{p}: waiting for the first batch")
                continue
            row = rows[-1]
            step, total = int(row["step"]), self.run.config.trainer_for(p).steps
            tok_s = row["tokens"] / max(1e-9, row["wait_s"] + row["train_s"])
            reward = generated_reward_smoothed(rows)[-1]
            parts.append(f"{p}: step {step}/{total} reward {reward:.2f} "
                         f"{tok_s / 1e3:.1f}k tok/s lag {row['version_lag']:.1f}")
        line = f"[{now - self.t0:5.0f}s] " + " | ".join(parts)
        if self.quiet:
            print(line, file=sys.stderr, flush=True)
        else:
            print("\r" + line.ljust(100), end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.quiet:
            print(file=sys.stderr)
