"""The live progress line of `astraflow run`: step, reward, tokens/s, staleness per policy.

Reads the trainers' metrics CSVs (the launcher never talks to trainers directly)."""
from __future__ import annotations

import csv
import sys
import time

from astraflow.config.rundir import RunDir


def last_row(path) -> dict | None:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (FileNotFoundError, csv.Error):
        return None
    # a line being written can be cut short: use the last complete one
    complete = [r for r in rows if r.get("train_s") not in (None, "")]
    return complete[-1] if complete else None


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
            row = last_row(self.run.path / "metrics" / f"{p}.csv")
            if row is None:
                parts.append(f"{p}: waiting for the first batch")
                continue
            step, total = int(row["step"]), self.run.config.trainer.steps
            tok_s = float(row["tokens"]) / max(1e-9, float(row["wait_s"]) + float(row["train_s"]))
            parts.append(f"{p}: step {step}/{total} reward {float(row['reward_mean']):.2f} "
                         f"{tok_s / 1e3:.1f}k tok/s lag {float(row['version_lag']):.1f}")
        line = f"[{now - self.t0:5.0f}s] " + " | ".join(parts)
        if self.quiet:
            print(line, file=sys.stderr, flush=True)
        else:
            print("\r" + line.ljust(100), end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.quiet:
            print(file=sys.stderr)
