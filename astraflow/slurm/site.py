"""Site profiles (`launchers/<site>.yaml`): how one cluster wants AstraFlow's jobs submitted.

Everything site-specific lives here, not in the run config: account, QOS, the dataflow
rank's partition, GPUs per task, modules to load, shell set-up, a container image, the MPI
plugin. Loaded strictly like a run config: an unknown key is rejected with the list of
valid ones, a wrong type or choice names the file and line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from astraflow.config.loader import load_typed
from astraflow.config.schema import choice

SITES_DIR = Path(__file__).resolve().parents[1] / "launchers"  # package data: found from any install


@dataclass(frozen=True)
class SiteProfile:
    account: str = ""
    qos: str = ""
    time: str = "04:00:00"  # per job, sbatch --time
    dataflow_partition: str = "cpu"  # het group 0; trainers and rollouts get --partitions
    cpus_per_task: int = 1
    tasks_per_node: int = 0  # trainer / rollout tasks per node (0: all of a component on one node)
    gpus_per_task: int = 0  # for trainer and rollout tasks; the dataflow task never gets one
    gpu_type: str = ""  # e.g. "h100": --gpus-per-task=h100:N
    mem: str = ""  # per node, sbatch --mem (empty: the partition's default)
    modules: tuple[str, ...] = ()  # `module load` each, in the job script
    setup: tuple[str, ...] = ()  # shell lines run before srun (activate an env, export vars)
    container_image: str = ""  # pyxis/enroot image: srun --container-image=...
    container_mounts: str = ""  # srun --container-mounts=... (the run directory's filesystem)
    mpi: str = choice("pmi2", "pmi2", "pmix")  # srun --mpi=
    python: str = ""  # interpreter on the compute nodes; empty: the one running astraflow-launch
    signal_s: int = 120  # Slurm's warning (SIGUSR1) this long before the time limit / preemption
    requeue: bool = True
    extra_sbatch: tuple[str, ...] = ()  # more `#SBATCH` options, verbatim, for every component


def site_path(site: str | None) -> Path:
    """A profile by path, or by name from the package's launchers/ (`local` when none is
    given; the repository's top-level launchers/ is a link to it)."""
    if site and (site.endswith((".yaml", ".yml")) or "/" in site):
        return Path(site)
    return SITES_DIR / f"{site or 'local'}.yaml"


def load_site(site: str | None) -> SiteProfile:
    return load_typed(SiteProfile, site_path(site))
