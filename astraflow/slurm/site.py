"""Site profiles (`launchers/<site>.yaml`): how one cluster wants AstraFlow's jobs submitted.

Everything site-specific lives here, not in the run config: account, QOS, the dataflow
rank's partition, GPUs per task, modules to load, shell set-up, a container image, the MPI
plugin. Loaded strictly like a run config: an unknown key is rejected with the list of
valid ones, a wrong type or choice names the file and line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from astraflow.config.loader import ConfigError, load_typed
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
    container_image: str = ""  # an image to run every component in (empty: none)
    container_mounts: str = ""  # SRC:DST[,SRC:DST]: the run directory's filesystem, inside the container
    # How the image runs: pyxis/enroot (srun --container-image, --container-mounts), or
    # Apptainer / Singularity (`apptainer exec [--nv] [--bind MOUNTS] IMAGE` before the
    # interpreter; --nv when tasks get GPUs), which national centres often allow alone
    container: str = choice("pyxis", "pyxis", "apptainer", "singularity")
    mpi: str = choice("pmi2", "pmi2", "pmix")  # srun --mpi=
    python: str = ""  # interpreter on the compute nodes; empty: the one running astraflow-launch
    signal_s: int = 120  # Slurm's warning (SIGUSR1) this long before the time limit / preemption
    requeue: bool = True
    extra_sbatch: tuple[str, ...] = ()  # more `#SBATCH` options, verbatim, for every component


def srun_container_args(site: SiteProfile) -> list[str]:
    """srun's own container options (pyxis/enroot); none for Apptainer or no image."""
    if site.container != "pyxis" or not site.container_image:
        return []
    return [f"--container-image={site.container_image}"] + \
        ([f"--container-mounts={site.container_mounts}"] if site.container_mounts else [])


def container_exec(site: SiteProfile) -> list[str]:
    """The words that run a command inside the image with Apptainer / Singularity, to go
    before the interpreter; [] for pyxis or no image. Unquoted: callers quote for a shell."""
    if site.container == "pyxis":
        return []
    if not site.container_image:
        raise ConfigError(f"container: {site.container} needs container_image (the .sif image to run in)")
    return [site.container, "exec", *(["--nv"] if site.gpus_per_task else []),
            *(["--bind", site.container_mounts] if site.container_mounts else []), site.container_image]


def site_path(site: str | None) -> Path:
    """A profile by path, or by name from the package's launchers/ (`local` when none is
    given; the repository's top-level launchers/ is a link to it)."""
    if site and (site.endswith((".yaml", ".yml")) or "/" in site):
        return Path(site)
    return SITES_DIR / f"{site or 'local'}.yaml"


def load_site(site: str | None) -> SiteProfile:
    return load_typed(SiteProfile, site_path(site))
