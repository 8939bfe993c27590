"""Rewards: the registry, `\\boxed{}` answers, and users' own reward functions — sync or
async, with or without the data set row — that raise, hang or return garbage: each scores 0,
is counted, and never reaches the caller as an exception."""
from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest

from astraflow.config.loader import ConfigError
from astraflow.workflows.rewards import Scorer, boxed_math, last_boxed, load_reward

USER_REWARDS = '''
import asyncio, time

def length(completion, answer):
    return len(completion) / 10

def by_level(completion, answer, row):
    return float(completion == answer) * row["level"]

async def remote(completion, answer):
    await asyncio.sleep(0.01)
    return 0.5

def broken(completion, answer):
    raise RuntimeError("the judge is down")

def slow(completion, answer):
    time.sleep(5)
    return 1.0

async def slow_async(completion, answer):
    await asyncio.sleep(5)
    return 1.0

def not_a_number(completion, answer):
    return float("nan")

def one_argument(completion):
    return 1.0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_boxed_answers():
    assert last_boxed(r"so \boxed{3} no, \boxed{\frac{1}{2}} .") == r"\frac{1}{2}"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{unclosed") is None
    assert boxed_math(r"12 - 5 = 7. The answer is \boxed{7}.", "7") == 1.0
    assert boxed_math(r"\boxed{0.5}", "1/2") == 1.0 and boxed_math(r"\boxed{8}", "7") == 0.0
    assert boxed_math("7", "7") == 0.0  # the format is part of what is rewarded


def test_user_rewards_are_called_as_they_are_written(user_module):
    async def go():
        row = {"level": 3}
        return [await Scorer(f"{user_module}:length", 1.0)("abcde", "x", row),
                await Scorer(f"{user_module}:by_level", 1.0)("7", "7", row),
                await Scorer(f"{user_module}:remote", 1.0)("7", "7", row)]

    assert asyncio.run(go()) == [0.5, 3.0, 0.5]


@pytest.mark.parametrize("name, kind", [("broken", "error"), ("slow", "timeout"), ("slow_async", "timeout"),
                                        ("not_a_number", "error")])
def test_a_reward_that_fails_scores_zero_and_is_counted(user_module, name, kind, caplog):
    scorer = Scorer(f"{user_module}:{name}", timeout_s=0.2)

    async def go():
        t0 = time.perf_counter()
        scores = await asyncio.gather(*(scorer("7", "7") for _ in range(5)))
        return scores, time.perf_counter() - t0

    scores, took = asyncio.run(go())
    assert scores == [0.0] * 5 and scorer.failures[kind] == 5 and took < 2.0  # in parallel, each cut at 0.2 s
    assert sum(f"reward {user_module}:{name}" in r.message for r in caplog.records) == 3  # the first few only


def test_bad_reward_names_are_config_errors(user_module):
    with pytest.raises(ConfigError, match=r"'nope' is not a registered reward \[.*'boxed_math'.*\] nor a"):
        load_reward("nope")
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_module'"):
        load_reward("no_such_module:score")
    with pytest.raises(ConfigError, match=r"module 'my_rewards' has no 'missing'"):
        load_reward(f"{user_module}:missing")
    with pytest.raises(ConfigError, match=r"takes 1 required arguments; expected \(completion, answer\)"):
        load_reward(f"{user_module}:one_argument")
