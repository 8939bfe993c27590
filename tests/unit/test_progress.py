"""What `astraflow run` shows while it runs and at the end: per policy the step with its
percentage and the time left; before the first step what the run waits for (the model's
preparation, the rank, the workers' engines, the first batch); nothing at all with
`--quiet`; and a short summary for a person at the end (the JSON stays in summary.json)."""
from __future__ import annotations

import pytest

from astraflow.analysis.metrics import append_metrics, metrics_path
from astraflow.launch.progress import Progress, duration, eta
from astraflow.launch.summary import format_summary
from astraflow.trainer.loop import METRIC_FIELDS
from tests.conftest import make_run


def write_steps(run, steps: int, seconds_per_step: float) -> None:
    for s in range(1, steps + 1):
        append_metrics(metrics_path(run.path, "policy"), METRIC_FIELDS,
                       {**dict.fromkeys(METRIC_FIELDS, 0.5), "step": s, "time": 1000.0 + s * seconds_per_step,
                        "generated": 8})


def test_the_line_shows_the_percentage_and_the_time_left(tmp_path, capsys):
    run = make_run(tmp_path, ["trainer.steps=40"])
    write_steps(run, 10, 3.0)
    progress = Progress(run, quiet=False)
    progress.update()
    err = capsys.readouterr().err
    assert "policy: step 10/40 (25%)" in err and "ETA 1m30s" in err  # 30 steps left at 3 s each


def test_before_the_first_step_the_line_says_what_the_run_waits_for(tmp_path, capsys):
    run = make_run(tmp_path)
    progress = Progress(run, quiet=False)
    progress.phase = "preparing the model (build and warm-up, once per run)"
    progress.update()
    assert "policy: preparing the model" in capsys.readouterr().err
    progress.phase, progress.last_print = "", 0.0
    progress.update()  # no rank is up in this run directory
    assert "policy: starting the dataflow rank" in capsys.readouterr().err


def test_the_waiting_line_counts_workers_and_samples_from_the_ranks_status(tmp_path):
    run = make_run(tmp_path, ["trainer.batch_size=16"])
    progress = Progress(run, quiet=True)
    status = {"workers": {"alive": 0}, "policies": {"policy": {"stored": 0}}}
    assert progress._waiting("policy", status) == "starting the rollout workers (loading their engines)"
    status = {"workers": {"alive": 2}, "policies": {"policy": {"stored": 5}}}
    assert progress._waiting("policy", status) == "generating the first batch (5/16 samples, 2 workers)"


def test_quiet_prints_nothing(tmp_path, capsys):
    run = make_run(tmp_path)
    write_steps(run, 3, 1.0)
    progress = Progress(run, quiet=True)
    progress.update()
    progress.close()
    assert capsys.readouterr().err == ""


def test_eta_and_durations():
    rows = [{"step": s, "time": 10.0 * s} for s in (1, 2, 3)]
    assert eta(rows, 10) == pytest.approx(70.0) and eta(rows[:1], 10) is None
    assert [duration(x) for x in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_the_end_of_a_run_is_a_short_summary_for_a_person(tmp_path):
    summary = {"run_dir": str(tmp_path), "wall_s": 66.5, "components_s": 60.0, "eval_accuracy_base": 0.5,
               "eval_accuracy": 0.935, "trajectories": 1000, "trained": 960, "samples_per_s": 16.0, "dropped": 40,
               "dropped_stale": 10, "filtered_zero_advantage": 30, "unused_trainer_done": 0, "target_reward": 0.8,
               "policies": {"policy": {"steps": 30, "reward_first": 0.145, "reward_last": 0.919,
                                       "time_to_target_s": 41.2, "version_lag": 0.4}}}
    text = format_summary(summary)
    assert len(text.splitlines()) <= 6 and not text.startswith("{")
    assert "reward (generated) 0.145 -> 0.919" in text and "0.500 -> 0.935" in text
    assert str(tmp_path / "summary.json") in text
