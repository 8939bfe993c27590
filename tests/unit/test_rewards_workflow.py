"""Rewards and the rlvr workflow's records."""
from __future__ import annotations

import asyncio

import numpy as np

from astraflow.config.schema import WorkflowConfig
from astraflow.models.factory import make_model
from astraflow.protocol.messages import Task
from astraflow.rollout.engines.base import SamplingParams
from astraflow.workflows import EpisodeContext
from astraflow.workflows.rewards import Scorer, exact_match, math_verify
from astraflow.workflows.rlvr import rlvr
from tests.conftest import constant, hf_engine


def test_exact_match_and_math_verify():
    assert exact_match(" 19", "19") == 1.0 and exact_match("91", "19") == 0.0
    assert math_verify("0.5", "1/2") == 1.0 and math_verify("4", "3") == 0.0
    assert math_verify("no number here", "3") == 0.0


def test_rlvr_builds_one_group_with_masks_versions_and_rewards(tmp_path):
    model_dir = make_model("llama", "tiny", tmp_path / "model", corpus=["3+4=7"])
    engine = hf_engine(model_dir)
    engine.version = 5
    ctx = EpisodeContext(engines={"solver": engine}, tokenizer=engine.tok, params=SamplingParams(4, stop=engine.tok.stop_ids),
                         reward=Scorer("exact_match", 5.0), policy_index={"solver": 1}, rng=np.random.default_rng(0),
                         roles={"policy": "solver"})
    trajs = asyncio.run(rlvr(Task(42, 30.0, "3+4=", "7", 4, ["solver"]), ctx))
    prompt = engine.tok.encode_prompt("3+4=")
    assert len(trajs) == 4 and all(t.group_id == 42 for t in trajs) and len({t.episode_id for t in trajs}) == 4
    for t in trajs:
        n = len(t.tokens) - len(prompt)
        assert t.tokens[: len(prompt)].tolist() == prompt and 1 <= n <= 4
        assert t.loss_mask.tolist() == [0] * len(prompt) + [1] * n
        assert t.versions.tolist() == [-1] * len(prompt) + [5] * n
        assert t.token_policy.tolist() == [-1] * len(prompt) + [1] * n
        assert (t.logprobs[: len(prompt)] == 0).all() and (t.logprobs[len(prompt):] < 0).all()
        completion = engine.tok.decode(t.tokens[len(prompt):])
        assert t.meta == {"completion": completion} and t.reward == exact_match(completion, "7")


def test_reference_guidance_adds_the_scored_answer_only_to_an_all_wrong_group(tmp_path):
    """With `workflow.reference_guidance`, a group whose answers all scored 0 (an untrained
    model) gets the reference answer as one more record: forced tokens, the engine's
    logprobs for them, reward 1, `guided` in its metadata. A group with a right answer (here:
    a reward that accepts anything) gets none."""
    model_dir = make_model("qwen2", "tiny", tmp_path / "model", corpus=["3+4=7"])
    engine = hf_engine(model_dir)
    ctx = EpisodeContext(engines={"p": engine}, tokenizer=engine.tok, params=SamplingParams(3, 0.7, stop=engine.tok.stop_ids),
                         reward=Scorer("exact_match", 5.0), policy_index={"p": 0}, rng=np.random.default_rng(0),
                         roles={"policy": "p"}, workflow=WorkflowConfig(reference_guidance=True))
    task = Task(7, 30.0, "3+4=", "7", 4, ["p"])
    *sampled, guided = asyncio.run(rlvr(task, ctx))
    prompt = engine.tok.encode_prompt("3+4=")
    assert len(sampled) == 4 and all(t.reward == 0 and "guided" not in t.meta for t in sampled)
    answer = engine.tok.encode_completion("7")
    assert guided.tokens.tolist() == prompt + answer and guided.reward == 1.0 and guided.group_id == 7
    assert guided.meta == {"completion": "7", "guided": True}
    assert guided.loss_mask.tolist() == [0] * len(prompt) + [1] * len(answer)
    assert (guided.logprobs[len(prompt):] < 0).all()

    ctx.reward = constant(1.0)
    assert len(asyncio.run(rlvr(task, ctx))) == 4
