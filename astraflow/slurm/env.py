"""What a Slurm task knows about itself, read from the environment Slurm gives it.

Inside a heterogeneous step `SLURM_JOB_PARTITION` is not reliably per component, and no
variable names the task's het group, so both are derived: the group is where `SLURM_PROCID`
falls in the cumulative `SLURM_NTASKS_HET_GROUP_<n>`, the partition is
`SLURM_JOB_PARTITION_HET_GROUP_<group>`.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

# The roles of the heterogeneous job's components, by het group (the order of the sbatch's
# `hetjob` blocks and of `srun --het-group=0,1,2`).
ROLES = ("dataflow", "trainer", "rollout")


@dataclass(frozen=True)
class SlurmTask:
    job_id: str
    procid: int  # rank in the whole step
    het_group: int
    group_rank: int  # rank within its het group
    group_size: int
    partition: str
    node: str

    @property
    def role(self) -> str:
        return ROLES[self.het_group]


def in_slurm(env: Mapping[str, str] = os.environ) -> bool:
    return "SLURM_JOB_ID" in env


def current_task(env: Mapping[str, str] = os.environ) -> SlurmTask:
    """This task's place in a heterogeneous step (a plain step is one group, group 0)."""
    procid = int(env.get("SLURM_PROCID", "0"))
    job = env.get("SLURM_JOB_ID", "")
    host = env.get("SLURMD_NODENAME", socket.gethostname())
    size = int(env.get("SLURM_HET_SIZE", "0"))
    if not size:
        return SlurmTask(job, procid, 0, procid, int(env.get("SLURM_NTASKS", "1")),
                         env.get("SLURM_JOB_PARTITION", "local"), host)
    if size != len(ROLES):
        raise RuntimeError(f"the AstraFlow job has {len(ROLES)} het groups ({', '.join(ROLES)}); "
                           f"this one has SLURM_HET_SIZE={size}")
    start = 0
    for g in range(size):
        n = int(env[f"SLURM_NTASKS_HET_GROUP_{g}"])
        if procid < start + n:
            return SlurmTask(env.get("SLURM_JOB_ID_HET_GROUP_0", job), procid, g, procid - start, n,
                             env.get(f"SLURM_JOB_PARTITION_HET_GROUP_{g}", "unknown"), host)
        start += n
    raise RuntimeError(f"SLURM_PROCID={procid} is beyond the het groups' {start} tasks")


def partition(env: Mapping[str, str] = os.environ) -> str:
    """The partition a component reports: set by the node supervisor, else Slurm's, else local."""
    return env.get("ASTRAFLOW_PARTITION") or env.get("SLURM_JOB_PARTITION") or "local"


def rollout_worker_id(env: Mapping[str, str] = os.environ) -> str:
    """A rollout worker's base id: `<array_job>_<task>` in an array, `<job>.<procid>` in a step."""
    if "SLURM_ARRAY_JOB_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '0')}"
    if "SLURM_JOB_ID" in env:
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_PROCID', '0')}"
    return f"{socket.gethostname()}-{os.getpid()}"
