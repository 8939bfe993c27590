"""Rollout job arrays: extra rollout workers for a running job, submitted with submitit.

Each array task supervises one rollout worker (id `<array_job>_<task>`, plus the dataflow
rank's restart counter) that finds the running dataflow rank through `RUN_DIR/rendezvous/`
and registers like any other worker. The task ends when its worker is drained (`scale
--remove`, the elastic controller), when the run is finished, or on Slurm's signals.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.launch.supervisor import Supervisor
from astraflow.slurm import jobs
from astraflow.slurm.env import partition, rollout_worker_id
from astraflow.slurm.site import SiteProfile, container_exec, srun_container_args
from astraflow.slurm.watch import STOP_TIMEOUT_S, Watch


def supervise_rollout(run: RunDir, worker_id: str, policies: tuple[str, ...],
                      env: dict[str, str] | None = None) -> bool:
    """Run one rollout worker, restarted when it crashes, until it leaves (drained, no tasks
    left), the run is finished, or a signal comes (then False). `env`: more environment for it."""
    sup = Supervisor(run.config.launcher.max_restarts, run.config.launcher.backoff_s)
    comp = sup.add(components.rollout(run, f"rollout-{worker_id}", worker_id, policies, env=env))
    try:
        return Watch(sup).until(lambda finished: comp.name in finished or components.finished_marker(run.path).exists())
    finally:
        sup.stop(timeout_s=STOP_TIMEOUT_S)


def rollout_array_task(run_dir: str) -> int:
    """What one array task runs (in the submitit job process on the compute node)."""
    # a single task is submitted as a plain job (submitit): it is task 0 of its "array"
    worker_id = rollout_worker_id() if "SLURM_ARRAY_JOB_ID" in os.environ else f"{os.environ['SLURM_JOB_ID']}_0"
    os.environ["ASTRAFLOW_PARTITION"] = partition()
    run = RunDir.open(run_dir)
    supervise_rollout(run, worker_id, run.config.task_policies)  # an added worker hosts what episodes need
    return 0


def time_minutes(limit: str) -> int:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]) as minutes, rounded up."""
    days, _, rest = limit.rpartition("-")
    try:
        parts = [int(x) for x in rest.split(":")]
        if not 1 <= len(parts) <= 3 or (days and not days.isdigit()):
            raise ValueError
    except ValueError:
        raise ValueError(f"time: {limit!r} is not a Slurm time limit ([D-]HH:MM:SS)") from None
    if days:
        h, m, s = (parts + [0, 0])[:3]
    else:
        h, m, s = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def submit_rollout_array(run: RunDir, n: int, partition_name: str, site: SiteProfile, python: str,
                         reason: str = "scale --add") -> str:
    """Submit an array of `n` rollout tasks on `partition_name`; returns the array's job id."""
    import submitit

    folder = run.path / "slurm" / "arrays" / "%j"
    # Apptainer runs the interpreter inside the image: submitit puts `python` on srun's command line
    python = " ".join(shlex.quote(word) for word in [*container_exec(site), python])
    executor = submitit.SlurmExecutor(folder=folder, python=python)
    setup = [f"module load {m}" for m in site.modules] + list(site.setup) + [f"cd {shlex.quote(str(Path.cwd()))}"]
    srun_args = srun_container_args(site)
    params = dict(partition=partition_name, time=time_minutes(site.time), cpus_per_task=site.cpus_per_task,
                  job_name="astraflow-rollout", array_parallelism=n, setup=setup, srun_args=srun_args,
                  signal_delay_s=site.signal_s, stderr_to_stdout=True,
                  # Slurm's warning reaches the worker as SIGUSR1, like the het step's workers
                  additional_parameters={"signal": f"USR1@{site.signal_s}", **_extra(site)})
    if site.account:
        params["account"] = site.account
    if site.qos:
        params["qos"] = site.qos
    if site.mem:
        params["mem"] = site.mem
    if site.gpus_per_task:
        params["gres"] = f"gpu:{site.gpu_type + ':' if site.gpu_type else ''}{site.gpus_per_task}"
    executor.update_parameters(**params)
    with jobs.outside_any_job():
        submitted = executor.map_array(rollout_array_task, [str(run.path)] * n)
    array_id = submitted[0].job_id.split("_")[0]
    jobs.add_array(run.path, array_id, n, partition_name, reason)
    return array_id


def _extra(site: SiteProfile) -> dict:
    out = {}
    for opt in site.extra_sbatch:
        key, _, value = opt.lstrip("-").partition("=")
        out[key] = value or True
    return out

