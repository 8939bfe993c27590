"""Slurm commands (sbatch, scancel, squeue, sacct) and the run's record of its jobs.

`RUN_DIR/slurm/jobs.json` lists every job submitted for the run — the heterogeneous job(s)
and each rollout array with the tasks cancelled since — so that `scale`, `status` and the
elastic controller agree on what exists. Writers (the launcher CLI, the controller inside
the job) take an exclusive lock on the file.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from astraflow.config.rundir import RunDir
    from astraflow.slurm.render import JobShape
    from astraflow.slurm.site import SiteProfile


class SlurmError(RuntimeError):
    pass


# Variables of an enclosing job (the elastic controller submits from inside the het job) that
# must not leak into a job submitted from it: the new job's srun would believe it is part of
# the enclosing heterogeneous job.
JOB_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_", "MPIR_", "HYDRA_")


@contextlib.contextmanager
def outside_any_job() -> Iterator[None]:
    """Submit as if from a login shell: the enclosing job's variables are hidden meanwhile."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(JOB_ENV_PREFIXES)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _slurm(*cmd: str, input: str | None = None) -> str:
    if shutil.which(cmd[0]) is None:
        raise SlurmError(f"{cmd[0]} not found: is this a Slurm login node? (one machine: tools/local-slurm.sh start)")
    done = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=60)
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(cmd[:2])}... failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def sbatch(script: Path, *args: str) -> str:
    """Submit a script file; returns the job id."""
    with outside_any_job():
        return _slurm("sbatch", "--parsable", str(script), *args).strip().split(";")[0]


def scancel(ids: list[str]) -> None:
    if ids:
        _slurm("scancel", *ids)


def squeue(job_ids: list[str]) -> list[dict]:
    """Queued and running jobs (array tasks one by one) among `job_ids`."""
    if not job_ids:
        return []
    out = _slurm("squeue", "-h", "--array", "-j", ",".join(job_ids), "-o", "%i|%T|%P|%M|%R|%j")
    keys = ("job_id", "state", "partition", "elapsed", "reason", "name")
    return [dict(zip(keys, line.split("|", 5))) for line in out.splitlines() if line.strip()]


def sacct(job_ids: list[str]) -> list[dict] | str:
    """Finished jobs' states, or why they cannot be had (accounting is often disabled)."""
    if not job_ids:
        return []
    try:
        out = _slurm("sacct", "-n", "-P", "-X", "-j", ",".join(job_ids), "-o", "JobID,State,Partition,Elapsed,ExitCode")
    except SlurmError as e:
        return str(e)
    keys = ("job_id", "state", "partition", "elapsed", "exit_code")
    return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]


# ---------------------------------------------------------------- the run's record

def record_path(run_path: Path) -> Path:
    return run_path / "slurm" / "jobs.json"


def load(run_path: Path) -> dict:
    path = record_path(run_path)
    return json.loads(path.read_text()) if path.exists() else {"hetjobs": [], "arrays": []}


@contextlib.contextmanager
def updating(run_path: Path) -> Iterator[dict]:
    """Read-modify-write the record under an exclusive lock."""
    path = record_path(run_path)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = load(run_path)
        yield record
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)


def submit_hetjob(run: "RunDir", shape: "JobShape", site: "SiteProfile", python: str) -> str:
    """Render the run's heterogeneous job into RUN_DIR/slurm/, submit and record it; its id."""
    from astraflow.slurm.render import render_hetjob

    script = run.path / "slurm" / "astraflow_het.sbatch"
    script.parent.mkdir(mode=0o700, exist_ok=True)
    script.write_text(render_hetjob(shape, site, str(run.path / "config.yaml"), python, run_dir=str(run.path),
                                    output=str(run.path / "logs" / "slurm-%j.out")))
    job_id = sbatch(script)
    with updating(run.path) as rec:
        rec["hetjobs"].append({"job_id": job_id, "partitions": list(shape.partitions), "submitted": time.time()})
    return job_id


def add_array(run_path: Path, job_id: str, tasks: int, partition: str, reason: str) -> None:
    with updating(run_path) as rec:
        rec["arrays"].append({"job_id": job_id, "tasks": tasks, "partition": partition, "reason": reason,
                              "submitted": time.time(), "cancelled": []})


def task_slurm_id(run_path: Path, base: str) -> str:
    """The Slurm id of the array task whose worker is `base` (`<array>_<task>`).

    submitit submits a single task as a plain job, not an array: its worker is `<job>_0`
    but Slurm knows it as `<job>`."""
    array, _, task = base.partition("_")
    single = any(a["job_id"] == array and a["tasks"] == 1 for a in load(run_path)["arrays"])
    return array if single else base


def worker_base(slurm_id: str) -> str:
    """Inverse of `task_slurm_id`: squeue's id of an array task (or single job) -> worker base."""
    return slurm_id if "_" in slurm_id else f"{slurm_id}_0"


def mark_cancelled(run_path: Path, worker_bases: list[str]) -> None:
    with updating(run_path) as rec:
        for a in rec["arrays"]:
            a["cancelled"] += [int(b.split("_")[1]) for b in worker_bases if b.split("_")[0] == a["job_id"]]


def all_job_ids(run_path: Path) -> list[str]:
    rec = load(run_path)
    ids = [j["job_id"] for j in rec["hetjobs"]] + [a["job_id"] for a in rec["arrays"]]
    # a hetjob submitted by hand (sbatch slurm/astraflow_het.sbatch) leaves rendezvous/job-<id>.json
    ids += [p.stem.split("-", 1)[1] for p in (run_path / "rendezvous").glob("job-*.json")]
    return sorted(set(ids), key=lambda i: int(i) if i.isdigit() else 0)
