"""Who joins which collective weight group: a local run's workers by `rollout.workers`, a het
job's by its rollout tasks (which may differ from the config's count); none on `filesystem`."""
from __future__ import annotations

import json

from astraflow.config.loader import parse_config
from astraflow.weights.groups import GROUPS_ENV, launch_env
from tests.conftest import REPO


def config(*sets: str):
    return parse_config((REPO / "configs" / "quickstart.yaml").read_text(), overrides=list(sets))


def groups(env: dict[str, str]) -> dict:
    return json.loads(env[GROUPS_ENV])


def test_a_local_run_groups_the_trainer_with_its_configured_workers():
    cfg = config("weights.channel=collective", "rollout.workers=2")
    assert groups(launch_env(cfg)) == {"policy": [0, 3]}
    assert [groups(launch_env(cfg, i)) for i in (0, 1)] == [{"policy": [1, 3]}, {"policy": [2, 3]}]


def test_a_het_job_groups_the_trainer_with_its_rollout_tasks():
    cfg = config("weights.channel=collective", "rollout.workers=2")
    assert groups(launch_env(cfg, workers=3)) == {"policy": [0, 4]}
    assert groups(launch_env(cfg, 2, workers=3)) == {"policy": [3, 4]}


def test_the_filesystem_channel_forms_no_group():
    assert launch_env(config("rollout.workers=2"), 0) == {}
