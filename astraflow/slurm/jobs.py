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
from typing import Iterator


class SlurmError(RuntimeError):
    pass


def _slurm(*cmd: str, input: str | None = None) -> str:
    if shutil.which(cmd[0]) is None:
        raise SlurmError(f"{cmd[0]} not found: is this a Slurm login node? (one machine: tools/local-slurm.sh start)")
    done = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=60)
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(cmd[:2])}... failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def sbatch(script: Path, *args: str) -> str:
    """Submit a script file; returns the job id."""
    return _slurm("sbatch", "--parsable", str(script), *args).strip().split(";")[0]


def scancel(ids: list[str], signal: str | None = None) -> None:
    if ids:
        _slurm("scancel", *([f"--signal={signal}", "--full"] if signal else []), *ids)


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


def add_hetjob(run_path: Path, job_id: str, partitions: list[str]) -> None:
    with updating(run_path) as rec:
        rec["hetjobs"].append({"job_id": job_id, "partitions": partitions, "submitted": time.time()})


def add_array(run_path: Path, job_id: str, tasks: int, partition: str, reason: str) -> None:
    with updating(run_path) as rec:
        rec["arrays"].append({"job_id": job_id, "tasks": tasks, "partition": partition, "reason": reason,
                              "submitted": time.time(), "cancelled": []})


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
