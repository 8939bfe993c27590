"""Rewards and the rlvr workflow's records."""
from __future__ import annotations

import asyncio

import numpy as np

from astraflow.models.factory import make_model
from astraflow.protocol.messages import Task
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.workflows import EpisodeContext
from astraflow.workflows.rewards import exact_match, math_verify
from astraflow.workflows.rlvr import rlvr


def test_exact_match_and_math_verify():
    assert exact_match(" 19", "19") == 1.0 and exact_match("91", "19") == 0.0
    assert math_verify("0.5", "1/2") == 1.0 and math_verify("4", "3") == 0.0
    assert math_verify("no number here", "3") == 0.0


def test_rlvr_builds_one_group_with_masks_versions_and_rewards(tmp_path):
    model_dir = make_model("llama", "tiny", tmp_path / "model", corpus=["3+4=7"])
    engine = HFEngine(model_dir, seed=0)
    engine.version = 5
    ctx = EpisodeContext(engines={"solver": engine}, codec=engine.codec, params=SamplingParams(4),
                         reward=exact_match, policy_index={"solver": 1}, rng=np.random.default_rng(0),
                         roles={"policy": "solver"})
    trajs = asyncio.run(rlvr(Task(42, 30.0, "3+4=", "7", 4, ["solver"]), ctx))
    prompt = engine.codec.encode_prompt("3+4=")
    assert len(trajs) == 4 and all(t.group_id == 42 for t in trajs) and len({t.episode_id for t in trajs}) == 4
    for t in trajs:
        n = len(t.tokens) - len(prompt)
        assert t.tokens[: len(prompt)].tolist() == prompt and 1 <= n <= 4
        assert t.loss_mask.tolist() == [0] * len(prompt) + [1] * n
        assert t.versions.tolist() == [-1] * len(prompt) + [5] * n
        assert t.token_policy.tolist() == [-1] * len(prompt) + [1] * n
        assert (t.logprobs[: len(prompt)] == 0).all() and (t.logprobs[len(prompt):] < 0).all()
        completion = engine.codec.decode(t.tokens[len(prompt):])
        assert t.meta == {"completion": completion} and t.reward == exact_match(completion, "7")
