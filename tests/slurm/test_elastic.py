"""The automatic elastic controller on a real local cluster: a hungry trainer grows the pool,
a throttled (SIGSTOPped) one shrinks it, within bounds and never reversing within the cooldown."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from astraflow.slurm import jobs
from tests.conftest import component_pids
from tests.slurm.conftest import events, launch, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

MIN, MAX, COOLDOWN = 0, 2, 8.0


def decisions(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "elastic.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def actions(run_dir: Path) -> list[dict]:
    return [d for d in decisions(run_dir) if d["action"] in ("grow", "shrink")]


def test_controller_grows_for_a_hungry_trainer_and_shrinks_for_a_throttled_one(tmp_path: Path, cancel_jobs):
    run_dir = tmp_path / "auto"
    cancel_jobs(run_dir)
    launch(run_dir, "trainer.steps=5000", "rollout.workers=1", "rollout.concurrency=2",
           "elastic.enabled=true", f"elastic.min_workers={MIN}", f"elastic.max_workers={MAX}", "elastic.step=1",
           "elastic.grow_above=0.3", "elastic.shrink_below=0.05", f"elastic.cooldown_s={COOLDOWN}",
           "elastic.interval_s=1", "dataflow.status_window_s=4")

    # one slow worker (2 episodes in flight): the trainer waits for data most of the time
    wait_for("the controller to grow the pool", lambda: any(a["action"] == "grow" for a in actions(run_dir)),
             120, run_dir)
    grown = [a for a in actions(run_dir) if a["action"] == "grow"][0]
    wait_for("the new array worker to register",
             lambda: any(e["base"].startswith(f"{grown['job_id']}_") for e in events(run_dir, "register")), 60, run_dir)

    # throttle the trainer: it stops asking for batches, its wait fraction falls to zero
    (trainer,) = component_pids(run_dir, "train")
    os.kill(trainer, signal.SIGSTOP)
    try:
        wait_for("the controller to shrink the pool",
                 lambda: any(a["action"] == "shrink" and a["removed"] for a in actions(run_dir)), 90, run_dir)
    finally:
        os.kill(trainer, signal.SIGCONT)

    acts = actions(run_dir)
    for a in acts:  # every decision logged with its inputs, and within bounds
        assert {"wait_fraction", "waits", "array_workers", "min", "max", "thresholds"} <= set(a)
        after = a["array_workers"] + (a["n"] if a["action"] == "grow" else -a["n"])
        assert MIN <= after <= MAX, a
        assert (a["wait_fraction"] > 0.3) if a["action"] == "grow" else (a["wait_fraction"] < 0.05), a
    for prev, nxt in zip(acts, acts[1:]):  # no decision, let alone an opposite one, within the cooldown
        assert nxt["time"] - prev["time"] >= COOLDOWN - 0.5, (prev, nxt)
    shrink = next(a for a in acts if a["action"] == "shrink" and a["removed"])
    assert shrink["time"] > grown["time"]
    # the array it submitted is really gone from the queue: drained and cancelled, or never started
    cancelled = {b for a in jobs.load(run_dir)["arrays"] for b in (f"{a['job_id']}_{t}" for t in a["cancelled"])}
    assert set(shrink["removed"]) <= cancelled
    wait_for("the removed task to leave the queue",
             lambda: not jobs.squeue([jobs.task_slurm_id(run_dir, b) for b in shrink["removed"]]), 30, run_dir)
    assert any(a["reason"].startswith("elastic") for a in jobs.load(run_dir)["arrays"])
