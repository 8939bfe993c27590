"""`astraflow status RUN_DIR`: the run's Slurm jobs, its workers and throughput per partition.

Jobs come from the run's record (slurm/jobs.json, rendezvous/job-*.json) through squeue
(live) and sacct (finished, where accounting is enabled); workers and rates from the live
dataflow rank's status when it answers.
"""
from __future__ import annotations

import json

from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.slurm import jobs


def run_status(run_dir: str) -> dict:
    run = RunDir.open(run_dir)
    ids = jobs.all_job_ids(run.path)
    report: dict = {"run_dir": str(run.path), "jobs": {"record": jobs.load(run.path), "queue": [], "finished": []},
                    "finished": (run.path / "summary.json").exists()}
    try:
        report["jobs"]["queue"] = jobs.squeue(ids)
        report["jobs"]["finished"] = jobs.sacct(ids)
    except jobs.SlurmError as e:
        report["jobs"]["error"] = str(e)
    try:
        status = components.dataflow_status(run, timeout_s=3)
    except (TimeoutError, FileNotFoundError):
        report["dataflow"] = None
    else:
        report["dataflow"] = {
            "workers_by_partition": status["workers"]["by_partition"],
            "throughput_per_partition": status["throughput"]["per_partition"],
            "policies": {p: {k: v[k] for k in ("trainer_step", "latest_version", "stored", "trainer_wait_fraction")}
                         for p, v in status["policies"].items()},
        }
    return report


def format_status(report: dict) -> str:
    lines = [f"run {report['run_dir']}" + (" (finished)" if report["finished"] else "")]
    queue = report["jobs"]["queue"]
    lines.append(f"jobs in the queue: {len(queue)}")
    lines += [f"  {j['job_id']:<14} {j['state']:<10} {j['partition']:<10} {j['elapsed']:>10}  {j['name']}" for j in queue]
    finished = report["jobs"]["finished"]
    if isinstance(finished, str):
        lines.append(f"finished jobs: unknown ({finished})")
    else:
        lines += [f"  {j['job_id']:<14} {j['state']:<10} {j['partition']:<10} {j['elapsed']:>10}" for j in finished]
    if "error" in report["jobs"]:
        lines.append(f"slurm: {report['jobs']['error']}")
    df = report["dataflow"]
    if df is None:
        lines.append("dataflow rank: not answering")
        return "\n".join(lines)
    lines.append("workers per partition: " + json.dumps(df["workers_by_partition"]))
    for part, rate in sorted(df["throughput_per_partition"].items()):
        lines.append(f"  {part:<10} {rate['trajectories_per_s']:8.1f} traj/s {rate['tokens_per_s'] / 1e3:8.1f}k tok/s")
    for p, v in df["policies"].items():
        lines.append(f"policy {p}: step {v['trainer_step']} version {v['latest_version']} stored {v['stored']} "
                     f"trainer waiting {100 * v['trainer_wait_fraction']:.0f}%")
    return "\n".join(lines)


def print_status(run_dir: str, as_json: bool) -> int:
    report = run_status(run_dir)
    print(json.dumps(report, indent=2) if as_json else format_status(report))
    return 0
