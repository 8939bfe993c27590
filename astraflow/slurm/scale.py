"""Grow and shrink a running job's rollout pool: `astraflow-launch scale RUN_DIR --add/--remove N`.

Growing submits a rollout array (arrays.py). Shrinking drains: the dataflow rank stops
leasing to the chosen workers, which finish what they hold (or hand it back) and exit; then
their array tasks are cancelled. Only array workers are removed, newest first — the het
job's own rollout tasks are the pool's floor. Anything the drain does not return in time is
still safe: cancelled workers' leases expire and their tasks are handed out again.
"""
from __future__ import annotations

import logging
import time

from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, wait_rendezvous
from astraflow.slurm import jobs

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.5
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def queued_array_tasks(run: RunDir, partition: str | None = None) -> list[str]:
    """Worker bases (`<array>_<task>`) of this run's array tasks present in the queue."""
    arrays = [a["job_id"] for a in jobs.load(run.path)["arrays"]]
    return [jobs.worker_base(j["job_id"]) for j in jobs.squeue(arrays)
            if j["state"] in ACTIVE_STATES and partition in (None, j["partition"])]


def array_workers(run: RunDir, status: dict, partition: str | None = None) -> list[dict]:
    """Alive, not draining workers of this run's live arrays, newest first."""
    arrays = {a["job_id"]: a for a in jobs.load(run.path)["arrays"]}
    out = []
    for w in status["workers"]["list"]:
        array, _, task = w["base"].partition("_")
        if (w["alive"] and not w["draining"] and array in arrays and task.isdigit()
                and int(task) not in arrays[array]["cancelled"] and partition in (None, w["partition"])):
            out.append(w)
    return sorted(out, key=lambda w: tuple(int(x) for x in w["base"].split("_")), reverse=True)


def drain(run: RunDir, bases: list[str], timeout_s: float = m.RETIRE_GRACE_S + 10) -> list[str]:
    """Retire workers and cancel their array tasks; returns those that left before the timeout."""
    client = Client(wait_rendezvous(run.path)["address"], run.read_secret(), timeout_s=10)
    try:
        client.call(m.Drain(bases))
        deadline = time.monotonic() + timeout_s
        left: list[str] = []
        while time.monotonic() < deadline:
            alive = {w["base"] for w in client.call(m.Status()).status["workers"]["list"] if w["alive"]}
            left = [b for b in bases if b not in alive]
            if len(left) == len(bases):
                break
            time.sleep(DRAIN_POLL_S)
    finally:
        client.close()
    jobs.scancel([jobs.task_slurm_id(run.path, b) for b in bases])
    jobs.mark_cancelled(run.path, bases)
    return left


def remove(run: RunDir, n: int, partition: str | None = None) -> list[str]:
    """Remove up to `n` array workers: tasks still starting (no worker registered yet, so
    holding nothing) are cancelled first, then registered ones are drained, newest first.
    Returns the worker bases removed."""
    status = components.dataflow_status(run)
    registered = {w["base"] for w in status["workers"]["list"]}
    starting = [b for b in queued_array_tasks(run, partition) if b not in registered][:n]
    jobs.scancel([jobs.task_slurm_id(run.path, b) for b in starting])
    jobs.mark_cancelled(run.path, starting)
    drained = [w["base"] for w in array_workers(run, status, partition)[:n - len(starting)]]
    if len(starting) + len(drained) < n:
        log.warning("only %d array workers%s can be removed (the het job's own rollout tasks stay)",
                    len(starting) + len(drained), f" on {partition}" if partition else "")
    if drained:
        drain(run, drained)
    return starting + drained
