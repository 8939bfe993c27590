"""The elastic controller: grows and shrinks the rollout pool from the trainers' hunger.

Input: the dataflow rank's `trainer_wait_fraction` (the share of the last
`dataflow.status_window_s` seconds that a trainer spent waiting for a batch; the maximum
over policies). Above `grow_above` it submits a rollout array of `step` tasks; below
`shrink_below` it drains `step` array workers (newest first) and cancels their tasks.
Bounds: the array workers present (queued or running, per squeue) stay within
[min_workers, max_workers]. Hysteresis: the gap between the thresholds, and a cooldown
after every action during which no decision is taken — so never the opposite one.

It acts (it does not only advise), and writes every decision with its inputs to
`RUN_DIR/logs/elastic.jsonl`. It runs in a thread of the dataflow rank's Slurm task.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time

from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.slurm import jobs, scale
from astraflow.slurm.arrays import submit_rollout_array
from astraflow.slurm.site import SiteProfile, load_site

log = logging.getLogger(__name__)

ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def decide(wait: float, workers: int, cfg, since_last_s: float) -> tuple[str, int]:
    """(action, n) for one look: "grow"/"shrink" n workers, or "hold" (n = 0), with the reason
    folded into the action name for the log: hold:cooldown, hold:bounds, hold:band."""
    if since_last_s < cfg.cooldown_s:
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


class ElasticController(threading.Thread):
    def __init__(self, run: RunDir, partition: str) -> None:
        super().__init__(name="elastic", daemon=True)
        self.run, self.cfg = run, run.config.elastic
        self.partition = self.cfg.partition or partition
        site_file = run.path / "slurm" / "site.yaml"
        self.site = load_site(str(site_file)) if site_file.exists() else SiteProfile()
        self.python = self.site.python or sys.executable
        self.last_action = float("-inf")
        self.stopping = threading.Event()
        self.log_path = run.path / "logs" / "elastic.jsonl"

    def run(self) -> None:  # noqa: D401 — threading.Thread's entry point
        while not self.stopping.wait(self.cfg.interval_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 — a failed look must not end the controller
                log.warning("elastic controller: %s", e)

    def stop(self) -> None:
        self.stopping.set()

    def array_tasks(self) -> list[str]:
        """Array tasks of this run present in the queue, `<array>_<task>`."""
        arrays = [a["job_id"] for a in jobs.load(self.run.path)["arrays"]]
        return [j["job_id"] for j in jobs.squeue(arrays) if j["state"] in ACTIVE_STATES]

    def tick(self) -> None:
        status = components.dataflow_status(self.run, timeout_s=5)
        waits = {p: v["trainer_wait_fraction"] for p, v in status["policies"].items()}
        wait = max(waits.values())
        present = self.array_tasks()
        now = time.monotonic()
        action, n = decide(wait, len(present), self.cfg, now - self.last_action)
        entry = {"time": time.time(), "action": action, "n": n, "wait_fraction": wait, "waits": waits,
                 "array_workers": len(present), "min": self.cfg.min_workers, "max": self.cfg.max_workers,
                 "thresholds": [self.cfg.shrink_below, self.cfg.grow_above], "cooldown_s": self.cfg.cooldown_s}
        if action == "grow":
            entry["job_id"] = submit_rollout_array(self.run, n, self.partition, self.site, self.python,
                                                   reason=f"elastic: wait {wait:.2f} > {self.cfg.grow_above}")
        elif action == "shrink":
            # array tasks still starting (no worker registered yet) go first: they hold nothing
            registered = {w["base"] for w in status["workers"]["list"]}
            starting = [t for t in present if t not in registered][:n]
            jobs.scancel(starting)
            jobs.mark_cancelled(self.run.path, starting)
            drained = [w["base"] for w in scale.array_workers(self.run, status)[:n - len(starting)]]
            if drained:
                scale.drain(self.run, drained)
            entry["removed"] = starting + drained
        if action in ("grow", "shrink"):
            self.last_action = time.monotonic()
            log.info("elastic: %s %d (wait fraction %.2f, %d array workers)", action, n, wait, len(present))
        with open(self.log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
