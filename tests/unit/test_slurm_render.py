"""Rendered Slurm scripts (golden files), site profiles, the Slurm environment of a task."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from astraflow.config.loader import ConfigError, load_config, parse_config
from astraflow.slurm.arrays import time_minutes
from astraflow.slurm.env import current_task, rollout_worker_id
from astraflow.slurm.render import JobShape, render_hetjob
from astraflow.slurm.site import SiteProfile, container_exec, load_site, srun_container_args
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden"
QUICKSTART = "configs/quickstart.yaml"


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME; ASTRAFLOW_UPDATE_GOLDEN=1 rewrites it (review the diff)."""
    path = GOLDEN / name
    if os.environ.get("ASTRAFLOW_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with ASTRAFLOW_UPDATE_GOLDEN=1 and review the diff"


def quickstart_script(**kw) -> str:
    cfg, site = load_config(REPO / QUICKSTART), load_site("local")
    return render_hetjob(JobShape.of(cfg, site, ["gpu-h100", "gpu-a100"]), site, QUICKSTART, ".venv/bin/python", **kw)


def test_checked_in_hetjob_script_is_the_rendered_one():
    assert (REPO / "slurm" / "astraflow_het.sbatch").read_text() == quickstart_script()


def test_golden_hetjob_with_spaces_and_quotes_in_paths():
    text = quickstart_script(run_dir="/scratch/my runs/it's here", output="/scratch/my runs/it's here/logs/slurm-%j.out")
    check_golden("hetjob_spaces_quotes.sbatch", text)
    assert '#SBATCH --output="/scratch/my runs/it\'s here/logs/slurm-%j.out"' in text
    assert "RUN_DIR=${ASTRAFLOW_RUN_DIR:-'/scratch/my runs/it'\"'\"'s here'}" in text


def test_golden_hetjob_for_a_real_cluster_profile():
    cfg = parse_config((REPO / QUICKSTART).read_text(), overrides=["trainer.world=2", "rollout.workers=8"])
    site = load_site(str(REPO / "launchers" / "example-cluster.yaml"))
    text = render_hetjob(JobShape.of(cfg, site, ["gpu-h100", "gpu-a100", "cpu-long"]), site,
                         "/home/me/astraflow/configs/quickstart.yaml", "python", run_dir="/lustre/me/runs/q1")
    check_golden("hetjob_example_cluster.sbatch", text)
    assert "#SBATCH --gpus-per-task=\"h100:1\"" in text and "module load cuda/12.4" in text
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks=8" in text  # 8 rollout workers, 4 per node


def test_golden_hetjob_in_an_apptainer_container():
    """Apptainer / Singularity: the interpreter runs inside the image (`apptainer exec --nv
    --bind ... IMAGE`), srun gets no pyxis options; a rollout array wraps its python the same way."""
    cfg = parse_config((REPO / QUICKSTART).read_text(), overrides=["rollout.workers=2"])
    site = load_site("example-apptainer")
    text = render_hetjob(JobShape.of(cfg, site, ["gpu-h100", "gpu-a100"]), site,
                         "/home/me/astraflow/configs/quickstart.yaml", site.python, run_dir="/lustre/me/runs/a1")
    check_golden("hetjob_apptainer.sbatch", text)
    assert ("apptainer exec --nv --bind /lustre:/lustre,/scratch /shared/images/astraflow.sif \"$PYTHON\" -m "
            "astraflow.cli.main node") in text
    assert "--container-image" not in text and "module load apptainer" in text
    singularity = replace(site, container="singularity", gpus_per_task=0, container_mounts="")
    assert container_exec(singularity) == ["singularity", "exec", "/shared/images/astraflow.sif"]
    with pytest.raises(ConfigError, match="container: apptainer needs container_image"):
        container_exec(replace(site, container_image=""))
    pyxis = replace(site, container="pyxis")
    assert container_exec(pyxis) == []
    assert srun_container_args(pyxis)[0] == "--container-image=/shared/images/astraflow.sif"


def test_a_double_quote_in_an_sbatch_value_is_rejected():
    with pytest.raises(ConfigError, match="double quote"):
        quickstart_script(output='/tmp/a"b/%j.out')


def test_partitions_are_validated():
    cfg, site = load_config(REPO / QUICKSTART), SiteProfile()
    with pytest.raises(ConfigError, match="TRAINER,ROLLOUT"):
        JobShape.of(cfg, site, ["gpu-h100"])
    shape = JobShape.of(cfg, site, ["gpu-h100", "gpu-a100"])
    assert shape.partitions == ("cpu", "gpu-h100", "gpu-a100") and shape.tasks == (1, 1, 1)
    standby_only = load_config(REPO / QUICKSTART, ["rollout.workers=0", "rollout.standby=/srv/standby"])
    with pytest.raises(ConfigError, match=r"rollout\.workers: a heterogeneous job needs >= 1 rollout task"):
        JobShape.of(standby_only, site, ["gpu-h100", "gpu-a100"])


def test_unknown_site_key_lists_the_valid_ones(tmp_path: Path):
    bad = tmp_path / "site.yaml"
    bad.write_text("account: x\nacount: y\n")
    with pytest.raises(ConfigError) as e:
        load_site(str(bad))
    assert f"{bad}:2" in str(e.value) and "acount" in str(e.value) and "'account'" in str(e.value)
    bad.write_text("mpi: openmpi\n")
    with pytest.raises(ConfigError, match="pmi2"):
        load_site(str(bad))


def test_shipped_site_profiles_load():
    for path in (REPO / "launchers").glob("*.yaml"):
        assert isinstance(load_site(str(path)), SiteProfile)


def test_time_limits():
    assert [time_minutes(t) for t in ("30", "10:30", "01:00:00", "2-03", "1-00:00:01")] == [30, 11, 60, 3060, 1441]
    with pytest.raises(ValueError, match="time"):
        time_minutes("an hour")


def test_het_group_of_a_task_from_the_environment():
    env = {"SLURM_JOB_ID": "41", "SLURM_PROCID": "3", "SLURM_HET_SIZE": "3", "SLURMD_NODENAME": "gpu-a100-1",
           "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2", "SLURM_NTASKS_HET_GROUP_2": "4",
           "SLURM_JOB_ID_HET_GROUP_0": "41", "SLURM_JOB_PARTITION": "cpu",
           "SLURM_JOB_PARTITION_HET_GROUP_0": "cpu", "SLURM_JOB_PARTITION_HET_GROUP_1": "gpu-h100",
           "SLURM_JOB_PARTITION_HET_GROUP_2": "gpu-a100"}
    task = current_task(env)
    assert (task.role, task.group_rank, task.group_size, task.partition) == ("rollout", 0, 4, "gpu-a100")
    assert current_task({**env, "SLURM_PROCID": "2"}).role == "trainer"
    assert rollout_worker_id({"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "9"}) == "7_3"
    assert rollout_worker_id({"SLURM_JOB_ID": "41", "SLURM_PROCID": "3"}) == "41.3"


def test_elastic_bounds_are_validated():
    with pytest.raises(ConfigError, match="shrink_below < grow_above"):
        parse_config((REPO / QUICKSTART).read_text(), overrides=["elastic.grow_above=0.1", "elastic.shrink_below=0.2"])
