"""The elastic controller: grows and shrinks the rollout pool from the trainers' hunger.

Input: the dataflow rank's `trainer_wait_fraction` (the share of the last
`dataflow.status_window_s` seconds that a trainer spent waiting for a batch; the maximum
over policies). Above `grow_above` it submits a rollout array of `step` tasks; below
`shrink_below` it drains `step` array workers (newest first) and cancels their tasks.
Bounds: the array workers present (queued or running, per squeue) stay within
[min_workers, max_workers]. Hysteresis: the gap between the thresholds, and a cooldown
after every action during which no decision is taken — so never the opposite one. An array
that left the queue without any worker registering (a bad partition, a broken environment)
doubles the cooldown, per failure in a row, rather than being resubmitted at full rate.

It acts (it does not only advise) through the same command a user has, `astraflow-launch
scale RUN_DIR --add/--remove N`, in a child process. Every decision is written with its inputs to `RUN_DIR/logs/elastic.jsonl`.
It runs in a thread of the dataflow rank's Slurm task.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.slurm import jobs
from astraflow.slurm.scale import queued_array_tasks
from astraflow.store.appendonly import append_json_line

log = logging.getLogger(__name__)


def decide(wait: float, workers: int, cfg, since_last_s: float, cooldown_s: float) -> tuple[str, int]:
    """(action, n) for one look: "grow"/"shrink" n workers, or "hold" (n = 0), with the reason
    folded into the action name for the log: hold:cooldown, hold:bounds, hold:band."""
    if since_last_s < cooldown_s:
        return "hold:cooldown", 0
    if workers < cfg.min_workers:
        return "grow", cfg.min_workers - workers
    if workers > cfg.max_workers:
        return "shrink", workers - cfg.max_workers
    if wait > cfg.grow_above:
        n = min(cfg.step, cfg.max_workers - workers)
        return ("grow", n) if n > 0 else ("hold:bounds", 0)
    if wait < cfg.shrink_below:
        n = min(cfg.step, workers - cfg.min_workers)
        return ("shrink", n) if n > 0 else ("hold:bounds", 0)
    return "hold:band", 0


def failed_in_a_row(arrays: list[dict], present: set[str], registered: set[str]) -> int:
    """How many of the newest controller arrays ended without a worker ever registering."""
    failed = 0
    for a in reversed([a for a in arrays if a["reason"].startswith("elastic")]):
        prefix = f"{a['job_id']}_"
        if a["cancelled"] or any(b.startswith(prefix) for b in present | registered):
            break
        failed += 1
    return failed


class ElasticController(threading.Thread):
    def __init__(self, run: RunDir, partition: str) -> None:
        super().__init__(name="elastic", daemon=True)
        self.rundir, self.cfg = run, run.config.elastic
        self.partition = self.cfg.partition or partition
        self.last_action = float("-inf")
        self.stopping = threading.Event()
        self.log_path = run.path / "logs" / "elastic.jsonl"

    def run(self) -> None:  # threading.Thread's entry point
        while not self.stopping.wait(self.cfg.interval_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 — a failed look must not end the controller
                log.warning("elastic controller: %s", e)

    def stop(self) -> None:
        self.stopping.set()

    def scale(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "astraflow.cli.launch", "scale", str(self.rundir.path), *args],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"astraflow-launch scale {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def tick(self) -> None:
        status = components.dataflow_status(self.rundir, timeout_s=5)
        waits = {p: v["trainer_wait_fraction"] for p, v in status["policies"].items()}
        wait = max(waits.values())
        present = queued_array_tasks(self.rundir)
        failed = failed_in_a_row(jobs.load(self.rundir.path)["arrays"], set(present),
                                 {w["base"] for w in status["workers"]["list"]})
        cooldown = self.cfg.cooldown_s * 2 ** failed
        action, n = decide(wait, len(present), self.cfg, time.monotonic() - self.last_action, cooldown)
        entry = {"time": time.time(), "action": action, "n": n, "wait_fraction": wait, "waits": waits,
                 "array_workers": len(present), "min": self.cfg.min_workers, "max": self.cfg.max_workers,
                 "thresholds": [self.cfg.shrink_below, self.cfg.grow_above], "cooldown_s": cooldown,
                 "failed_arrays": failed}
        if action == "grow":
            out = self.scale("--add", str(n), "--partition", self.partition,
                             "--reason", f"elastic: wait {wait:.2f} > {self.cfg.grow_above}")
            entry["job_id"] = out.split("rollout array ")[1].split()[0]
        elif action == "shrink":
            out = self.scale("--remove", str(n))
            entry["removed"] = out.split("workers: ")[1].split() if "workers: " in out else []
        if action in ("grow", "shrink"):
            self.last_action = time.monotonic()
            log.info("elastic: %s %d (wait fraction %.2f, %d array workers)", action, n, wait, len(present))
        append_json_line(self.log_path, entry)
