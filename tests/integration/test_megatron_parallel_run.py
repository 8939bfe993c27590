"""`astraflow run` with the megatron backend at tp = 2 and at pp = 2: two trainer ranks form
one tensor-parallel group, or two pipeline stages (one model replica either way). Both ranks
train every step on the same rows (each logs the digest of its rows and its loss: they must
be equal), rank 0 alone publishes and acknowledges, each rank writes its shard of the
checkpoints, and a group that loses a rank (SIGKILL) is restarted as a whole and resumes
from its checkpoint with every step's samples acknowledged exactly once; `astraflow audit`
agrees. A run stopped at one layout resumes at another.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from astraflow.store.journal import replay
from tests.conftest import REPO, component_pids, parity_prompts
from tests.integration.test_local_run import BATCH, OVERRIDES, metric_rows

pytestmark = pytest.mark.integration

STEPS = 6
TRAINED = re.compile(r"rank (\d) trained step (\d+) on (\d+) samples \(ids (\w+)\): loss (\S+)")


def rank_pid(run_dir: Path, rank: int) -> int:
    """The pid of trainer rank `rank` (its ASTRAFLOW_RANK)."""
    for pid in component_pids(run_dir, "train"):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"ASTRAFLOW_RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no trainer rank {rank} running")


def start_run(tmp_path: Path, *sets: str) -> subprocess.Popen:
    """`astraflow run` of the parity task in `tmp_path / "run"`: megatron, two trainer ranks
    (a layout in `sets`), checkpoints every 2 steps."""
    overrides = [*OVERRIDES, "trainer.checkpoint_every=2", "rollout.workers=1", "trainer.backend=megatron",
                 "trainer.world=2", f"tasks.path={parity_prompts(tmp_path / 'parity.jsonl')}", *sets]
    return subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "run", "configs/quickstart.yaml",
                             "--run-dir", str(tmp_path / "run"), "--quiet", *[a for o in overrides for a in ("--set", o)]],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(launcher: subprocess.Popen, run_dir: Path, rows: int) -> None:
    """Until the run has trained `rows` steps (it must not exit first)."""
    deadline = time.monotonic() + 180
    while len(metric_rows(run_dir)) < rows:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "no training progress"
        time.sleep(0.2)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_model_parallel_ranks_train_on_the_same_rows_and_resume_after_losing_one(tmp_path, tp, pp):
    run_dir = tmp_path / "run"
    launcher = start_run(tmp_path, f"trainer.steps={STEPS}", f"trainer.tp={tp}", f"trainer.pp={pp}")
    try:
        wait_for_rows(launcher, run_dir, 3)  # past the first checkpoint (step 2)
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        out, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    log = (run_dir / "logs" / "trainer-policy.log").read_text()
    assert "(restart 1)" in log  # the whole group, not the lost rank alone
    # every step's whole batch to both ranks: the same rows (digest) and the same loss
    trained: dict[int, dict[int, set]] = defaultdict(lambda: defaultdict(set))
    for rank, step, n, digest, loss in TRAINED.findall(log):
        assert int(n) == BATCH, (rank, step, n)
        trained[int(rank)][int(step)].add((digest, loss))
    assert sorted(trained[0]) == sorted(trained[1]) == list(range(1, STEPS + 1))
    assert all(trained[0][s] == trained[1][s] for s in trained[0]), dict(trained)
    # rank 0 acknowledged each step once, its whole batch; nothing trained twice
    consumed = {ev["step"]: ev["ids"] for ev in replay(run_dir / "journal") if ev["ev"] == "consumed"}
    assert sorted(consumed) == list(range(1, STEPS + 1))
    ids = [i for step in consumed.values() for i in step]
    assert len(ids) == len(set(ids)) == STEPS * BATCH
    assert sorted({int(r["step"]) for r in metric_rows(run_dir)}) == list(range(1, STEPS + 1))
    assert {int(r["samples"]) for r in metric_rows(run_dir)} == {BATCH}  # one replica: the batch once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["trained"] == STEPS * BATCH
    # each rank's shard of the last checkpoint, committed together
    assert sorted(p.name for p in (run_dir / "checkpoints" / "policy" / f"step-{STEPS}").iterdir()) == \
        sorted(f"tp{t}-pp{p}-dp0.pt" for t in range(tp) for p in range(pp))
    audit = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "audit", str(run_dir)], cwd=REPO,
                           capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]


def test_a_run_resumes_at_another_layout(tmp_path):
    """A run stopped (SIGTERM) at tp = 2 resumes with `--set trainer.tp=1 --set trainer.pp=2`:
    the trainers load its last checkpoint cut again into two pipeline stages (`reshard.py`),
    train the remaining steps and write checkpoints of the new layout; nothing is trained
    twice or lost (`astraflow audit`)."""
    run_dir = tmp_path / "run"
    launcher = start_run(tmp_path, "trainer.steps=8", "trainer.tp=2")
    try:
        wait_for_rows(launcher, run_dir, 3)
        launcher.send_signal(signal.SIGTERM)  # the trainers checkpoint their step and stop
        launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stopped = max(int(r["step"]) for r in metric_rows(run_dir))
    assert stopped < 8
    resumed = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "run", "--run-dir", str(run_dir), "--quiet",
                              "--set", "trainer.tp=1", "--set", "trainer.pp=2"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (run_dir / "logs" / "trainer-policy.log").read_text()
    assert "resumed from step-" in log
    assert sorted(p.name for p in (run_dir / "checkpoints" / "policy" / "step-8").iterdir()) == \
        ["tp0-pp0-dp0.pt", "tp0-pp1-dp0.pt"]
    assert sorted({int(r["step"]) for r in metric_rows(run_dir)}) == list(range(1, 9))
    audit = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "audit", str(run_dir)], cwd=REPO,
                           capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
