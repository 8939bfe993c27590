"""The run summary's rewards: means over the samples generated, not over steps, so that a step
that saw one new group (served from the buffer's surplus) does not swing them; and the metrics
CSV a restarted trainer writes: one row per step, each step trained counted once."""
import csv
import math
from pathlib import Path

import pytest

from astraflow.analysis.metrics import (append_metrics, generated_reward, generated_reward_smoothed, metrics_path,
                                        read_metrics)
from astraflow.launch.summary import policy_summary
from astraflow.trainer.loop import METRIC_FIELDS


def row(step: int, reward: float, generated: int) -> dict[str, float]:
    return {"step": step, "time": 100.0 + step, "reward_mean": reward, "generated": generated, "samples": 128,
            "completion_len": 3.0, "version_lag": 1.0}


def test_a_step_weighs_by_the_samples_it_saw() -> None:
    rows = [row(1, 0.5, 300), row(2, 0.0, 8), row(3, 1.0, 0)]  # step 3: nothing new, reward carried over
    assert generated_reward(rows) == 150 / 308
    smoothed = generated_reward_smoothed(rows, steps=2)
    # step 3 generated nothing: its window reaches back over the last 2 steps that did
    assert smoothed[0] == 0.5 and smoothed[1] == 150 / 308 and smoothed[2] == 150 / 308
    assert math.isnan(generated_reward([row(1, float("nan"), 0)]))  # truly nothing generated
    assert math.isnan(generated_reward_smoothed([row(1, float("nan"), 0), row(2, 0.5, 8)])[0])


def test_one_lucky_group_does_not_reach_the_target() -> None:
    # unweighted, steps 6-10 average 0.84; over their samples the reward is 0.61
    rows = [row(s, 0.2, 256) for s in range(1, 6)] + [row(6, 0.6, 512), row(7, 0.6, 512), row(8, 1.0, 8),
                                                      row(9, 1.0, 8), row(10, 1.0, 8)]
    rows += [row(s, 0.9, 256) for s in range(11, 21)]
    out = policy_summary(rows, t_start=100.0, target=0.8)
    # steps 7-11: 0.71 over their samples; steps 8-12: 0.90
    assert out["samples_to_target"] == 128 * 12
    assert out["time_to_target_s"] == 12.0
    assert out["reward_first"] == pytest.approx(0.2) and out["reward_last"] == pytest.approx(0.9)
    assert out["trained"] == 128 * 20 and out["steps"] == 20


def test_the_reward_windows_pass_over_steps_that_generated_nothing() -> None:
    """The CI failure `reward_last = nan`: the last 10% of a run's steps were all served from
    the buffer's surplus or replayed after a trainer restart (0 samples generated)."""
    rows = [row(s, 0.1, 64) for s in range(1, 4)] + [row(s, 0.5, 64) for s in range(4, 23)]
    rows[0]["generated"] = rows[1]["generated"] = 0  # the first steps, served from warm-up surplus
    rows += [row(23, 1.0, 0), row(24, 1.0, 0)]
    out = policy_summary(rows, t_start=100.0, target=0.8)
    # k = 2 steps: the last 2 (and first 2) steps that generated samples
    assert out["reward_last"] == pytest.approx(0.5) and out["reward_first"] == pytest.approx(0.3)
    assert out["steps"] == 24 and out["trained"] == 128 * 24


def write_like_a_restarted_trainer(path: Path) -> None:
    """Steps 1-10, killed while writing step 11's row, resumed from the checkpoint of step 8:
    steps 9 and 10 replayed (their rows again, 0 generated), then steps 11-20."""
    def line(step: int, generated: int, reward: float, loss: float) -> dict:
        return {**dict.fromkeys(METRIC_FIELDS, 0.5), "step": step, "time": 100.0 + step, "generated": generated,
                "reward_mean": reward, "samples": 128, "loss": loss}

    for s in range(1, 11):
        append_metrics(path, METRIC_FIELDS, line(s, 128, 0.2, 1.0))
    with open(path, "a") as f:
        f.write("1")  # the torn start of step 11's row: glued to the next one it would read as step 19
    for s in (9, 10):
        append_metrics(path, METRIC_FIELDS, line(s, 0, 0.0, 2.0))
    for s in range(11, 21):
        append_metrics(path, METRIC_FIELDS, line(s, 128 if s < 19 else 0, 0.9, 1.0))


def test_a_restarted_trainers_metrics_count_each_step_once(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    path = metrics_path(tmp_path, "policy")
    write_like_a_restarted_trainer(path)
    with open(path, newline="") as f:
        written = [int(r["step"]) for r in csv.DictReader(f)]
    assert written == [*range(1, 11), 9, 10, *range(11, 21)]  # the torn line was cut off, not glued on
    rows = read_metrics(tmp_path, "policy")
    assert [int(r["step"]) for r in rows] == list(range(1, 21))
    # a replayed step: the replay's training columns, the first row's generation (it happened once)
    assert rows[8]["loss"] == 2.0 and rows[8]["generated"] == 128 and rows[8]["reward_mean"] == pytest.approx(0.2)
    out = policy_summary(rows, t_start=100.0, target=0.8)
    assert out["trained"] == 128 * 20 and out["steps"] == 20
    assert out["reward_first"] == pytest.approx(0.2) and out["reward_last"] == pytest.approx(0.9)
    assert out["time_to_target_s"] == 15.0  # steps 11-15: the first 5 generating steps at 0.9


def test_a_torn_header_is_written_again(tmp_path: Path) -> None:
    path = tmp_path / "policy.csv"
    path.write_text("step,ti")
    append_metrics(path, ("step", "time"), {"step": 1, "time": 2.0})
    assert path.read_text().splitlines() == ["step,time", "1,2.0"]
