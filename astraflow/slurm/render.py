"""The heterogeneous job script, rendered from a run config and a site profile.

One template, so that `slurm/astraflow_het.sbatch` (checked in, for `sbatch` by hand) and
what `astraflow-launch` submits cannot drift apart: a test re-renders the checked-in script
and compares. Components (het groups, in this order): 0 the dataflow rank, 1 the trainers
(`trainer.world` tasks per policy), 2 the rollout workers (`rollout.workers` tasks).

Quoting: `#SBATCH` values are double-quoted (sbatch's own parser; a value holding `"` or a
newline is rejected), shell words are quoted with `shlex.quote`.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from astraflow.config.loader import ConfigError
from astraflow.config.schema import Config
from astraflow.slurm.site import SiteProfile, container_exec, srun_container_args

ROLE_COMMENTS = ("het group 0: the dataflow rank", "het group 1: trainers", "het group 2: rollout workers")


@dataclass(frozen=True)
class JobShape:
    """What the heterogeneous job asks for, per het group."""
    partitions: tuple[str, str, str]  # dataflow, trainer, rollout
    tasks: tuple[int, int, int]

    @classmethod
    def of(cls, cfg: Config, site: SiteProfile, partitions: list[str]) -> "JobShape":
        if not 2 <= len(partitions) <= 3 or not all(partitions):
            raise ConfigError(f"--partitions: expected TRAINER,ROLLOUT[,DATAFLOW] partitions, got {','.join(partitions)!r}")
        trainer, rollout = partitions[0], partitions[1]
        dataflow = partitions[2] if len(partitions) == 3 else site.dataflow_partition
        if cfg.rollout.workers < 1:
            raise ConfigError("rollout.workers: a heterogeneous job needs >= 1 rollout task (its het group 2); "
                              "standby workers (rollout.standby) join besides them")
        return cls((dataflow, trainer, rollout), (1, cfg.trainer.world * len(cfg.policy_names), cfg.rollout.workers))


def _sbatch(option: str, value: object) -> str:
    text = str(value)
    if '"' in text or "\n" in text:
        raise ConfigError(f"sbatch --{option}: {text!r} holds a double quote or a newline, which #SBATCH cannot carry")
    return f'#SBATCH --{option}="{text}"'


def render_hetjob(shape: JobShape, site: SiteProfile, config: str, python: str,
                  run_dir: str | None = None, output: str | None = None, job_name: str = "astraflow") -> str:
    """The sbatch script. `run_dir=None` leaves it to the script: `runs/<config stem>-<job id>`."""
    lines = ["#!/bin/bash",
             "# AstraFlow: one heterogeneous Slurm job — dataflow rank, trainers, rollout workers.",
             "# Rendered by astraflow-launch (astraflow/slurm/render.py); do not edit by hand.",
             "#   sbatch slurm/astraflow_het.sbatch [CONFIG]",
             "# Per-component options go between colons: sbatch -p cpu : -p gpu-h100 : -p gpu-a100 ...",
             "# The run directory is $ASTRAFLOW_RUN_DIR, else runs/<config name>-<job id>; a requeued",
             "# job keeps its id and so resumes the same run.",
             _sbatch("job-name", job_name)]
    if output:
        lines.append(_sbatch("output", output))
    if site.requeue:
        lines.append("#SBATCH --requeue")
    for group, (partition, ntasks) in enumerate(zip(shape.partitions, shape.tasks)):
        if group:
            lines.append("#SBATCH hetjob")
        lines.append(f"# {ROLE_COMMENTS[group]}")
        lines.append(_sbatch("partition", partition))
        nodes = -(-ntasks // site.tasks_per_node) if group and site.tasks_per_node else 1
        lines += [f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks={ntasks}", f"#SBATCH --cpus-per-task={site.cpus_per_task}"]
        lines.append(_sbatch("time", site.time))
        lines.append(f"#SBATCH --signal=USR1@{site.signal_s}")
        if site.account:
            lines.append(_sbatch("account", site.account))
        if site.qos:
            lines.append(_sbatch("qos", site.qos))
        if site.mem:
            lines.append(_sbatch("mem", site.mem))
        if group and site.gpus_per_task:
            gpus = f"{site.gpu_type}:{site.gpus_per_task}" if site.gpu_type else site.gpus_per_task
            lines.append(_sbatch("gpus-per-task", gpus))
        lines += [f"#SBATCH {opt}" for opt in site.extra_sbatch]
    lines += ["set -euo pipefail", ""]
    lines += [f"module load {shlex.quote(mod)}" for mod in site.modules]
    lines += list(site.setup)
    run_default = shlex.quote(run_dir) if run_dir else 'runs/"$(basename "$CONFIG" .yaml)-$SLURM_JOB_ID"'
    lines += [f"CONFIG=${{1:-{shlex.quote(config)}}}",
              f"RUN_DIR=${{ASTRAFLOW_RUN_DIR:-{run_default}}}",
              f"PYTHON=${{ASTRAFLOW_PYTHON:-{shlex.quote(python)}}}",
              ""]
    srun = ["srun", "--het-group=0,1,2", f"--mpi={site.mpi}", "--kill-on-bad-exit=0"]
    srun += [shlex.quote(arg) for arg in srun_container_args(site)]
    srun += [shlex.quote(word) for word in container_exec(site)]  # Apptainer: around the interpreter
    lines += ["# MPI joins the tasks at start-up only; a task that dies does not end the step",
              "rc=0",
              " ".join(srun) + ' "$PYTHON" -m astraflow.cli.main node --config "$CONFIG" --run-dir "$RUN_DIR" || rc=$?',
              "# a task lost on the way (killed, its node failed) does not fail a run that finished",
              'if [[ -f "$RUN_DIR/summary.json" ]]; then exit 0; fi',
              'exit "$rc"', ""]
    return "\n".join(lines)
