"""`astraflow bench elastic`: how fast a rollout array joins a running job.

On a Slurm cluster (tools/local-slurm.sh on one machine): submit the quickstart as a
heterogeneous job, wait until it trains, then `repeats` times: t0 = the `scale --add 1`
call; the new array task is a new Slurm process starting with a cold engine. Reported per
repeat and as medians: `join_s` (t0 → the worker registered with the dataflow rank),
`engine_load_s` (the worker's own measure of loading its engines, inside join_s),
`first_commit_s` (t0 → its first trajectory stored). Each added worker is drained before
the next repeat; the job is cancelled at the end.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.slurm import jobs, scale
from astraflow.slurm.arrays import submit_rollout_array
from astraflow.slurm.render import JobShape
from astraflow.slurm.site import load_site
from astraflow.store.journal import replay
from astraflow.store.reader import load_rows

POLL_S = 0.1


def _wait(what: str, cond, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"bench elastic: no {what} within {timeout_s:.0f}s")


def _registered(run: RunDir, base: str) -> dict | None:
    return next((e for e in replay(run.path / "journal") if e.get("ev") == "register" and e["base"] == base), None)


def _first_commit(run: RunDir, base: str) -> float | None:
    rows = load_rows(run.path)
    mine = rows[rows.worker.str.startswith(f"{base}.r")]
    return float(mine.t_commit.min()) if len(mine) else None


def run_bench(config: str, partitions: list[str], array_partition: str, engine: str, repeats: int) -> dict:
    site = load_site("local")
    run = RunDir.create(Path(tempfile.mkdtemp(prefix="astraflow-bench-elastic-")) / "run", config,
                        ["trainer.steps=100000", "warmup.steps=5", f"engine.kind={engine}", "rollout.workers=1"])
    jobs.submit_hetjob(run, JobShape.of(run.config, site, partitions), site, sys.executable)
    samples = []
    try:
        _wait("training", lambda: (run.path / "metrics" / "policy.csv").exists(), 300)
        for _ in range(repeats):
            t0 = time.time()
            array = submit_rollout_array(run, 1, array_partition, site, sys.executable, reason="bench elastic")
            base = f"{array}_0"
            reg = _wait(f"registration of {base}", lambda: _registered(run, base), 300)
            first = _wait(f"a trajectory from {base}", lambda: _first_commit(run, base), 300)
            samples.append({"join_s": reg["time"] - t0, "engine_load_s": reg.get("engine_load_s", 0.0),
                            "first_commit_s": first - t0})
            scale.drain(run, [base])
        status = components.dataflow_status(run)
    finally:
        jobs.scancel(jobs.all_job_ids(run.path))
    medians = {k: statistics.median(s[k] for s in samples) for k in ("join_s", "engine_load_s", "first_commit_s")}
    return {"bench": "elastic", "engine": engine, "repeats": repeats, "partitions": partitions,
            "array_partition": array_partition, **medians, "samples": samples, "run_dir": str(run.path),
            "workers_seen": len(status["workers"]["list"])}
