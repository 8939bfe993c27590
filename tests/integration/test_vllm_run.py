"""The main job as shipped (`configs/quickstart.yaml`, the vllm-batch engine), shortened to 100
steps: the rollout worker generates through vLLM and swaps in every new version, the policy
learns (the generated reward rises, the last weights score clearly better on the held-out
prompts than the starting ones), the evaluation started beside the run scores both through
its own vLLM engine, and the shards carry what the engine generated with. One of the two CI
tests that start vLLM (the other: tests/unit/test_vllm_engine.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from astraflow.config.loader import load_config
from astraflow.store.journal import replay
from astraflow.store.reader import ShardReader, iter_shards, load_rows
from tests.conftest import REPO, require

pytestmark = pytest.mark.integration

# Measured, 5 runs each (held-out accuracy from 0.26; generated reward, first -> last 10%):
#  30 steps: held-out 0.23-0.335, reward +0.03 to +0.08 (no learning to assert);
#  60 steps: held-out 0.335-0.49, reward +0.10 to +0.12;
# 100 steps: held-out 0.47-0.65, reward +0.15 to +0.18, 29-35 s wall (30 steps: 23-27 s).
STEPS = 100


def test_the_main_job_runs_on_vllm(tmp_path):
    require("vllm")
    run_dir = tmp_path / "run"
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    assert cfg.engine.kind == "vllm-batch"
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "run", "configs/quickstart.yaml",
                          "--run-dir", str(run_dir), "--quiet", "--set", f"trainer.steps={STEPS}"],
                         cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["trained"] == STEPS * cfg.trainer.batch_size
    # the warm-up checkpoint is weak (docs: 0.26 held-out); RL improves on it: the thresholds
    # are half the smallest gains measured (see STEPS)
    assert 0 < summary["eval_accuracy_base"] <= 0.5 and summary["eval_version"] == STEPS
    assert summary["eval_accuracy"] >= summary["eval_accuracy_base"] + 0.1, summary
    assert summary["reward_last"] >= summary["reward_first"] + 0.08, summary

    # the worker swapped in version after version (not one load at the end)
    loaded = [int(v) for v in re.findall(r"loaded weights v(\d+)", (run_dir / "logs" / "rollout-0.log").read_text())]
    assert len(loaded) >= STEPS // 2 and loaded == sorted(loaded)

    # what the trainer consumed respected the bound: step s trains on versions >= s - 1 - bound
    rows = load_rows(run_dir).set_index("sample_id")
    consumed = {ev["step"]: ev["ids"] for ev in replay(run_dir / "journal") if ev["ev"] == "consumed"}
    assert sorted(consumed) == list(range(1, STEPS + 1))
    bound = cfg.policies[0].max_staleness
    for step, ids in consumed.items():
        assert rows.loc[ids, "version_min"].min() >= step - 1 - bound, step
    assert rows["version_max"].max() <= STEPS and rows["version_max"].nunique() > STEPS // 2
    for path in iter_shards(run_dir):
        reader = ShardReader(path)
        for row in np.linspace(0, reader.n_rows - 1, 20).astype(int):
            t = reader.trajectory(int(row))
            own = t["loss_mask"].astype(bool)
            assert np.isfinite(t["logprobs"][own]).all() and (t["logprobs"][own] <= 0).all()
            assert t["version_min"] == t["versions"][own].min()
        reader.close()
