"""The live progress line of `astraflow run` (and of `astraflow-launch` following a job): per
policy the step out of the run's steps with its percentage, the reward (of the samples
generated over the last few steps that generated any, as in the plot and the summary),
tokens/s, staleness, and the estimated time left (from the seconds per step so far).

Before a policy's first step it says what the run is waiting for: the model's preparation
(`phase`, set by the launcher), the dataflow rank, the rollout workers' engines, or the
first batch (samples stored so far of the batch size). It reads the trainers' metrics CSVs
and asks the dataflow rank for its status only then (the launcher never talks to trainers).

On a terminal the line is redrawn every second; otherwise (a log, CI) a line is written
every `LOG_EVERY_S`; `quiet` writes nothing."""
from __future__ import annotations

import sys
import time

from astraflow.analysis.metrics import generated_reward_smoothed, read_metrics
from astraflow.config.rundir import RunDir
from astraflow.launch.components import dataflow_status
from astraflow.protocol.codec import RemoteError

LOG_EVERY_S = 10.0
STATUS_TIMEOUT_S = 0.5


def eta(rows: list[dict], total: int) -> float | None:
    """Seconds until step `total`, at the mean time per step since the first one (None before a
    second step)."""
    if len(rows) < 2:
        return None
    per_step = (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"] or 1)
    return max(0.0, per_step * (total - rows[-1]["step"]))


def duration(seconds: float) -> str:
    """`1h02m`, `4m05s`, `12s`."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, run: RunDir, quiet: bool) -> None:
        self.run, self.quiet = run, quiet
        self.live = sys.stderr.isatty()
        self.t0 = time.time()
        self.last_print = 0.0
        self.phase = ""  # what the launcher is doing before the components can work

    def update(self) -> None:
        now = time.time()
        if self.quiet or now - self.last_print < (1.0 if self.live else LOG_EVERY_S):
            return
        self.last_print = now
        line = f"[{duration(now - self.t0):>6}] " + " | ".join(self._parts())
        if self.live:
            print("\r" + line.ljust(110), end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def _parts(self) -> list[str]:
        parts, status = [], None
        for p in self.run.config.policy_names:
            rows = read_metrics(self.run.path, p)
            total = self.run.config.trainer_for(p).steps
            if not rows:
                status = status or self._status()
                parts.append(f"{p}: {self._waiting(p, status)}")
                continue
            row = rows[-1]
            step = int(row["step"])
            tok_s = row["tokens"] / max(1e-9, row["wait_s"] + row["train_s"])
            reward = generated_reward_smoothed(rows)[-1]
            left = eta(rows, total)
            parts.append(f"{p}: step {step}/{total} ({step / total:.0%}) reward {reward:.2f} "
                         f"{tok_s / 1e3:.1f}k tok/s lag {row['version_lag']:.1f}"
                         + (f" ETA {duration(left)}" if left is not None else ""))
        return parts

    def _waiting(self, policy: str, status: dict | None) -> str:
        if self.phase:
            return self.phase
        if status is None:
            return "starting the dataflow rank"
        if not status["workers"]["alive"]:
            return "starting the rollout workers (loading their engines)"
        stored = status["policies"][policy]["stored"]
        return (f"generating the first batch ({stored}/{self.run.config.trainer_for(policy).batch_size} samples, "
                f"{status['workers']['alive']} workers)")

    def _status(self) -> dict | None:
        try:
            return dataflow_status(self.run, timeout_s=STATUS_TIMEOUT_S)
        except (TimeoutError, OSError, ValueError, RemoteError):  # not up yet, restarting, unreachable
            return None

    def close(self) -> None:
        if self.live and not self.quiet:
            print(file=sys.stderr)
