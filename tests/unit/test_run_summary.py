"""The run summary's rewards: means over the samples generated, not over steps, so that a step
that saw one new group (served from the buffer's surplus) does not swing them."""
import math

import pytest

from astraflow.analysis.metrics import generated_reward, generated_reward_smoothed
from astraflow.launch.summary import policy_summary


def row(step: int, reward: float, generated: int) -> dict[str, float]:
    return {"step": step, "time": 100.0 + step, "reward_mean": reward, "generated": generated, "samples": 128,
            "completion_len": 3.0, "version_lag": 1.0}


def test_a_step_weighs_by_the_samples_it_saw() -> None:
    rows = [row(1, 0.5, 300), row(2, 0.0, 8), row(3, 1.0, 0)]  # step 3: nothing new, reward carried over
    assert generated_reward(rows) == 150 / 308
    smoothed = generated_reward_smoothed(rows, steps=2)
    assert smoothed[0] == 0.5 and smoothed[1] == 150 / 308 and smoothed[2] == 0.0
    assert math.isnan(generated_reward([row(1, float("nan"), 0)]))


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
