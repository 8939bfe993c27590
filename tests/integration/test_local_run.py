"""`astraflow run`: the whole system as local processes, a real model learning, with crashes."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from astraflow.analysis.metrics import read_metrics
from astraflow.analysis.plot import plot_run
from astraflow.analysis.report import write_report
from astraflow.store.journal import replay
from astraflow.store.reader import ShardReader, iter_shards, load_rows
from tests.browser import assert_shows_report, render
from tests.conftest import REPO, component_pids, parity_prompts
from tests.unit.test_report import SECTIONS

pytestmark = pytest.mark.integration

STEPS, BATCH = 24, 64
# A task this tiny model provably learns within seconds (the parity of a number, from a random
# init): the test is about the system carrying a learning signal through crashes, and the
# quickstart's arithmetic does not give one in 24 steps.
OVERRIDES = [f"trainer.steps={STEPS}", f"trainer.batch_size={BATCH}", "trainer.checkpoint_every=4",
             "trainer.lr=0.003", "warmup.steps=0", "tasks.warmup=0", "tasks.kind=jsonl", "engine.max_tokens=3",
             "launcher.backoff_s=0.2", "dataflow.heartbeat_timeout_s=3", "dataflow.lease_s=5",
             "rollout.workers=2", "rollout.concurrency=8", "engine.kind=hf"]


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "policy.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_local_run_learns_and_survives_killed_worker_and_trainer(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*OVERRIDES, f"tasks.path={parity_prompts(tmp_path / 'parity.jsonl')}"]
    sets = [a for o in overrides for a in ("--set", o)]
    launcher = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "run", "configs/quickstart.yaml",
                                 "--run-dir", str(run_dir), "--quiet", *sets], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while len(metric_rows(run_dir)) < 6:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "no training progress"
            time.sleep(0.2)
        for role in ("rollout", "train"):
            pids = component_pids(run_dir, role)
            assert pids, role
            os.kill(pids[0], signal.SIGKILL)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert out.startswith(f"run {run_dir} finished in ") and len(out.splitlines()) <= 6, out  # for a person
    assert "ETA" not in err and "step 1/" not in err  # --quiet: no progress lines
    summary = json.loads((run_dir / "summary.json").read_text())
    # each step counted once, although the restarted trainer replayed (and wrote rows for) some
    assert summary["steps"] == STEPS and summary["trained"] == STEPS * BATCH
    assert len(read_metrics(run_dir, "policy")) == STEPS
    # wall time runs from the start (config written) to the end of the evaluation (eval.json)
    evaluated, began = (run_dir / "eval.json").stat().st_mtime, (run_dir / "config.yaml").stat().st_mtime
    assert summary["components_s"] < summary["wall_s"] and began + summary["wall_s"] + 1.0 >= evaluated
    assert summary["reward_last"] > summary["reward_first"] + 0.02, summary  # a learning signal
    assert "(restart 1)" in (run_dir / "logs" / "trainer-policy.log").read_text()
    worker_logs = [(run_dir / "logs" / f"rollout-{i}.log").read_text() for i in range(2)]
    assert "(restart 1)" in "".join(worker_logs)
    # at the end the workers leave before the rank stops: their leases go back to it
    assert all("left the pool" in log and "could not hand back" not in log for log in worker_logs)
    assert list((run_dir / "metrics" / "tensorboard" / "policy").glob("events.out.tfevents.*"))
    png = plot_run(run_dir, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the run's report as a browser shows it: no errors, every section, every plot drawn
    assert_shows_report(render(write_report(run_dir, tmp_path / "report.html")), SECTIONS)
    steps = [int(r["step"]) for r in metric_rows(run_dir)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))  # resumed from its checkpoint, no gap
    assert all(0 < float(r["entropy"]) < np.log(256) for r in metric_rows(run_dir))

    # every stored trajectory is consistent with what the trainer consumed
    df = load_rows(run_dir)
    assert summary["trajectories"] == len(df)  # counted after the workers' last commits, as inspect counts
    consumed: dict[int, list[int]] = {}
    for ev in replay(run_dir / "journal"):
        if ev["ev"] == "consumed":
            consumed[ev["step"]] = ev["ids"]  # a replayed step overwrites: the surviving lineage
    assert sorted(consumed) == list(range(1, STEPS + 1))
    trained = [s for ids in consumed.values() for s in ids]
    assert len(trained) == len(set(trained)) == STEPS * BATCH  # nothing trained twice
    assert set(trained) <= set(df["sample_id"])
    assert set(df["policy"]) == {"policy"} and df["version_max"].max() <= STEPS
    # the same shards split by the task's answer (the parity: "0" or "1")
    answers = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "answers", str(run_dir), "--json"],
                             cwd=REPO, capture_output=True, text=True, check=True)
    by_answer = json.loads(answers.stdout)["policies"]["policy"]["answers"]
    assert [r["answer"] for r in by_answer] == ["0", "1"]
    # the quickstart's reference guidance: all-wrong groups got the reference, counted apart
    # (the summary's counts are the rank's when the trainer finished; the workers commit on)
    guided = df[df["guided"] == 1]
    assert 0 < summary["guided"] <= len(guided) and summary["generated"] <= len(df) - len(guided)
    assert sum(r["samples"] for r in by_answer) == len(df) - len(guided)
    assert sum(r["guided"] for r in by_answer) == len(guided) and (guided["reward"] == 1).all()
    for path in iter_shards(run_dir):
        reader = ShardReader(path)
        for row in np.linspace(0, reader.n_rows - 1, 20).astype(int):
            t = reader.trajectory(int(row))
            own = t["loss_mask"].astype(bool)
            assert own.any() and (t["token_policy"][own] == 0).all() and (t["token_policy"][~own] == -1).all()
            assert (t["logprobs"][own] <= 0).all() and (t["versions"][own] >= 0).all()
            assert t["version_min"] == t["versions"][own].min()
        reader.close()


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_two_trainer_ranks_train_one_batch_per_step_together(tmp_path, backend):
    """Two data-parallel ranks (DDP; Megatron's data-parallel group), each a slice of every
    step, with the KL term's frozen reference model."""
    run_dir = tmp_path / "run"
    overrides = [*OVERRIDES, "trainer.world=2", "trainer.steps=4", "rollout.workers=1", "trainer.ref_kl=0.5",
                 f"trainer.backend={backend}", f"tasks.path={parity_prompts(tmp_path / 'parity.jsonl')}"]
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "run", "configs/quickstart.yaml",
                          "--run-dir", str(run_dir), "--quiet", *[a for o in overrides for a in ("--set", o)]],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    consumed = {ev["step"]: ev["ids"] for ev in replay(run_dir / "journal") if ev["ev"] == "consumed"}
    assert sorted(consumed) == [1, 2, 3, 4]
    assert all(len(ids) == len(set(ids)) == BATCH for ids in consumed.values())  # both ranks' halves
    ready = [ev for ev in replay(run_dir / "journal") if ev["ev"] == "ready"]
    assert ready and all(ev["world"] == 2 for ev in ready)
    assert [int(r["samples"]) for r in metric_rows(run_dir)] == [BATCH] * 4
    # the KL to the starting policy: 0 before the first update, small after one, then growing
    kl = [float(r["kl_ref"]) for r in metric_rows(run_dir)]
    assert 0 < kl[0] < 0.05 and all(k > 0 for k in kl) and max(kl) > kl[0]


def test_failed_preparation_stops_the_components_started_with_it(tmp_path):
    """Trainers and workers start with the model's preparation and wait for the model: when
    the preparation fails, the launcher names its log, quotes its error and stops every one of them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "models").write_text("")  # a file where the warmed-up models go: the preparation fails there
    overrides = [*OVERRIDES, "warmup.steps=2", "tasks.warmup=8", f"tasks.path={parity_prompts(tmp_path / 'parity.jsonl')}"]
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "run", "configs/quickstart.yaml",
                          "--run-dir", str(run_dir), "--quiet", *[a for o in overrides for a in ("--set", o)]],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    # the launcher quotes the preparation's own error from its log
    assert f"astraflow run: model preparation failed, see {run_dir / 'logs' / 'prepare.log'}; its log ends:" \
        in out.stderr, out.stderr[-2000:]
    assert "NotADirectoryError" in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]
    assert "NotADirectoryError" in (run_dir / "logs" / "prepare.log").read_text()
    assert all(not component_pids(run_dir, role) for role in ("dataflow", "train", "rollout", "eval"))
    for name in ("dataflow", "trainer-policy", "rollout-0", "rollout-1"):  # they had been started
        assert (run_dir / "logs" / f"{name}.log").read_text().startswith(f"--- start {name} "), name
