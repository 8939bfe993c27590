"""Standby rollout workers: one engine process serves two runs in turn, each from its own start.

A real `astraflow rollout --standby` process and two real `astraflow run`s that announce
themselves to it (`rollout.standby`, no workers of their own). What could go wrong and is
checked: the second run is served by another process (the journal names the pid), or by
engines still holding the first run's trained weights (its version-0 logprobs would not
match a teacher-forced pass of its own starting model), or the worker leaves with the first
run instead of standing by.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.bench.multipolicy import registered_pids
from astraflow.config.rundir import RunDir
from astraflow.models import policy_model_dir
from astraflow.store.reader import load_rows, load_trajectory
from tests.conftest import REPO, parity_prompts
from tests.unit.test_models_engine import teacher_forced

pytestmark = pytest.mark.integration

OVERRIDES = ["trainer.steps=6", "trainer.batch_size=64", "trainer.lr=0.003", "warmup.steps=0", "tasks.warmup=0",
             "tasks.kind=jsonl", "engine.max_tokens=3", "engine.kind=hf", "rollout.concurrency=8",
             "rollout.workers=0", "policies.policy.filter_zero_advantage=false"]  # data, not learning


def version0_logprobs_match_the_starting_model(run_dir: Path, n: int = 8) -> None:
    cfg = RunDir.open(run_dir).config
    model = AutoModelForCausalLM.from_pretrained(policy_model_dir(run_dir, cfg, "policy"), dtype=torch.float32).eval()
    rows = load_rows(run_dir)
    first = rows[rows["version_max"] == 0].head(n)
    assert len(first) == n
    for shard, row in zip(first["shard"], first["row"]):
        t = load_trajectory(run_dir, shard, int(row))
        k = int(np.argmax(t["loss_mask"]))  # the prompt ends where the generated tokens start
        lp = teacher_forced(model, t["tokens"][:k].tolist(), t["tokens"][k:], cfg.engine.temperature)
        generated = t["loss_mask"][k:].astype(bool)
        np.testing.assert_allclose(t["logprobs"][k:][generated], lp[generated], atol=1e-4)


def test_a_standby_worker_serves_two_runs_in_turn_each_from_its_own_starting_weights(tmp_path):
    standby = tmp_path / "standby"
    standby.mkdir(mode=0o700)
    prompts = parity_prompts(tmp_path / "parity.jsonl")
    log = open(tmp_path / "standby.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "rollout", "--standby", str(standby),
                               "--worker-id", "standby-0"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        runs = [tmp_path / "a", tmp_path / "b"]
        for run_dir in runs:
            sets = [a for o in [*OVERRIDES, f"tasks.path={prompts}", f"rollout.standby={standby}"]
                    for a in ("--set", o)]
            done = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "run", "configs/quickstart.yaml",
                                   "--run-dir", str(run_dir), "--quiet", *sets],
                                  cwd=REPO, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            assert registered_pids(run_dir) == [worker.pid]
        assert worker.poll() is None, "the standby worker left with a run"
        text = (tmp_path / "standby.log").read_text()
        assert text.count("engines built") == 1 and text.count("engines kept") == 1, text[-3000:]
        assert text.count("left the pool") == 2, text[-3000:]  # leases handed back to a listening rank
        version0_logprobs_match_the_starting_model(runs[1])
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
    assert worker.returncode == 0
