"""`astraflow run configs/code.yaml`, a few steps with two attempts per episode: real processes,
a real tiny model, every answer graded in the real sandbox. The shards hold the episodes with
their rewards (the fraction of hidden tests passed) and why each lost reward; a second
attempt follows the first one's failing test, which is context, never trained."""
from __future__ import annotations

import json

import pytest

from astraflow.sandbox import Sandbox
from astraflow.store.reader import iter_trajectories
from tests.integration.test_multi_policy_run import SMALL, astraflow_run

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(Sandbox.check() is not None, reason=str(Sandbox.check()))]


def test_code_run_stores_graded_episodes_with_test_feedback(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "trainer.steps=3", "trainer.batch_size=16", "tasks.group_size=4", "rollout.concurrency=4",
                 "workflow.max_turns=2", "engine.max_tokens=12"]
    launcher = astraflow_run("configs/code.yaml", run_dir, overrides)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 3 and summary["failed_episodes"] == {}

    records = list(iter_trajectories(run_dir))
    assert len(records) >= 16
    retried = 0
    for r in records:
        meta = r["meta"]
        assert meta["tests"] >= 4 and r["reward"] == pytest.approx(meta["passed"] / meta["tests"])
        assert (meta["reason"] is None) == (meta["passed"] == meta["tests"])
        assert meta["turns"] in (1, 2) and (meta["turns"] == 2 or meta["reason"] is None)
        if meta["turns"] == 2:  # the first attempt failed: its failure is context before the second
            retried += 1
            trained = r["token_policy"] >= 0
            assert (r["loss_mask"].astype(bool) == trained).all()
            assert ((~trained).nonzero()[0] > trained.nonzero()[0][0]).any()  # context after the first answer
    assert retried > 0
