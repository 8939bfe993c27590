"""Multi-policy and agentic workflows on real tiny models: per-policy loss masks, the
verifier's balanced reward, and a tool-using agent against a real environment server and
the real sandbox."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from typing import Callable, Iterator

import numpy as np
import pytest

from astraflow.config.loader import parse_config
from astraflow.config.schema import WorkflowConfig
from astraflow.environments.client import EnvironmentClient
from astraflow.models.factory import make_model
from astraflow.protocol.messages import Task, Trajectory
from astraflow.rollout.engines.base import SamplingParams
from astraflow.sandbox import Sandbox
from astraflow.tasks.sources import Item, TaskSource
from astraflow.trainer.warmup import warm_up
from astraflow.workflows import EpisodeContext, EpisodeError
from astraflow.workflows.cotrain import ClassPrior, balance, solve_and_check, solver_verifier, written_wrong
from astraflow.workflows.rewards import Scorer, exact_match
from astraflow.workflows.tool_agent import multi_turn_tool
from tests.conftest import REPO, constant, hf_engine

TASK = Task(7, 30.0, "3+4+2=", "9", 6, ["solver", "verifier"])
INDEX = {"solver": 0, "verifier": 1}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_model("qwen2", "tiny", tmp_path_factory.mktemp("m") / "model", corpus=["3+4+2=9?YN!>;"])
    e = hf_engine(model)
    yield e
    e.close()


def context(engine, engines: dict, roles: dict, **workflow) -> EpisodeContext:
    return EpisodeContext(engines=engines, tokenizer=engine.tok, params=SamplingParams(4, 1.0, stop=engine.tok.stop_ids), reward=Scorer("exact_match", 5.0),
                          policy_index=INDEX, rng=np.random.default_rng(0), roles=roles,
                          workflow=WorkflowConfig(**workflow))


def trained_owner(t: Trajectory) -> set[int]:
    return set(t.token_policy[t.loss_mask == 1].tolist())


@pytest.mark.parametrize("workflow", [solver_verifier, solve_and_check])
def test_each_policy_trains_only_its_own_tokens(engine, workflow):
    engine.version = 3
    ctx = context(engine, {"solver": engine, "verifier": engine}, {"solver": "solver", "verifier": "verifier"})
    records = asyncio.run(workflow(TASK, ctx))
    solver = [r for r in records if r.policy == "solver"]
    verifier = [r for r in records if r.policy == "verifier"]
    assert len(solver) == len(verifier) == TASK.group_size
    for s, v in zip(solver, verifier):
        assert trained_owner(s) == {0} and trained_owner(v) == {1}
        assert (s.versions[s.loss_mask == 1] == 3).all() and (s.logprobs[s.loss_mask == 1] < 0).all()
        assert s.reward == exact_match(s.meta["completion"], "9") and s.episode_id == v.episode_id
        if workflow is solve_and_check:  # one sequence, two masks that split the generated tokens
            assert np.array_equal(s.tokens, v.tokens)
            assert not (s.loss_mask & v.loss_mask).any()
            assert np.array_equal(s.loss_mask | v.loss_mask, (s.token_policy >= 0).astype(np.uint8))
        else:  # the verifier sees the answer as context it did not generate
            answer = s.tokens[s.loss_mask == 1]
            assert (v.token_policy == 0).sum() == 0 and answer.tolist() == v.tokens[len(s.tokens) - len(answer):len(s.tokens)].tolist()


def test_retry_after_rejection_adds_a_second_attempt(engine):
    ctx = context(engine, {"solver": engine, "verifier": engine}, {"solver": "solver", "verifier": "verifier"},
                  retry=True)
    records = asyncio.run(solver_verifier(TASK, ctx))
    for episode in {r.episode_id for r in records}:
        mine = [r for r in records if r.episode_id == episode and r.policy == "verifier"]
        assert [r.meta["attempt"] for r in mine] == list(range(len(mine)))
        assert all(not r.meta["accept"] for r in mine[:-1])  # only a rejection brings another attempt


@pytest.mark.parametrize("solver_right", [False, True])
def test_verifier_contrast_shows_the_verifier_the_class_a_group_lacks(engine, solver_right):
    """With `verifier_contrast`, a group of only wrong answers has the verifier also judge the
    reference answer, and a group of only right ones a drawn wrong answer (the reward scores
    every answer one way here): one more verifier record, `guided`, whose context holds that
    answer and whose trained tokens are the verdict alone."""
    ctx = context(engine, {"solver": engine, "verifier": engine}, {"solver": "solver", "verifier": "verifier"},
                  verifier_contrast=True)
    ctx.reward = constant(float(solver_right))
    records = asyncio.run(solver_verifier(TASK, ctx))
    solver = [r for r in records if r.policy == "solver"]
    verifier = [r for r in records if r.policy == "verifier"]
    assert len(solver) == TASK.group_size and all(r.meta["truth"] == solver_right for r in verifier[:-1])
    extra = verifier[-1]
    assert len(verifier) == TASK.group_size + 1 and extra.meta["guided"] and extra.meta["truth"] != solver_right
    assert (extra.meta["completion"] == "9") == (not solver_right)
    shown = engine.tok.encode_completion(extra.meta["completion"])
    verdict = extra.tokens[extra.loss_mask == 1]
    assert trained_owner(extra) == {1} and extra.tokens[-len(verdict):].tolist() == verdict.tolist()
    assert extra.tokens[: -len(verdict)].tolist() == [*engine.tok.encode_prompt(TASK.prompt), *shown,
                                                      *engine.tok.encode_text("?")]
    assert extra.reward >= 0 and (extra.reward > 0) == (extra.meta["accept"] == extra.meta["truth"])
    assert not any(r.meta.get("guided") for r in records[:-1])


@pytest.mark.parametrize("solver_right", [False, True])
def test_reference_guidance_gives_an_all_wrong_solver_group_the_reference_answer(engine, solver_right):
    """With `reference_guidance`, a group whose answers all scored 0 also gets the reference
    answer as the solver's: scored by its engine (the forced tokens, with their logprobs),
    reward 1, `guided`, its trained tokens the answer alone; a group with a right answer does not."""
    ctx = context(engine, {"solver": engine, "verifier": engine}, {"solver": "solver", "verifier": "verifier"},
                  reference_guidance=True)
    ctx.reward = constant(float(solver_right))
    records = asyncio.run(solver_verifier(TASK, ctx))
    solver = [r for r in records if r.policy == "solver"]
    guided = [r for r in solver if r.meta.get("guided")]
    assert len(solver) == TASK.group_size + (not solver_right) and len(guided) == (not solver_right)
    if guided:
        (reference,) = guided
        answer = engine.tok.encode_completion(TASK.target)
        assert reference.reward == 1.0 and trained_owner(reference) == {0}
        assert reference.tokens[reference.loss_mask == 1].tolist() == answer
        assert (reference.logprobs[reference.loss_mask == 1] < 0).all()


def test_the_verifier_judges_answers_written_as_the_solver_writes_them():
    """Where the solver is taught to write `\\boxed{N}` (word problems), the verifier's
    contrast and warm-up answers are written so too: the right one is the target, a wrong one
    the target with another number in the answer's place (a bare number would teach it to
    judge a form it never sees)."""
    rng = np.random.default_rng(0)
    item = Item("Ann has 3 apples and buys 4. How many?", "7", "\\boxed{7}")
    wrong = [written_wrong(item, rng) for _ in range(20)]
    assert all(w.startswith("\\boxed{") and w.endswith("}") and w != "\\boxed{7}" for w in wrong)
    assert written_wrong(Item("3+4=", "7"), rng) != "7"  # a bare target: a bare wrong number


def test_verifier_reward_mean_is_its_balanced_accuracy():
    def judged(truth: bool, accept: bool) -> Trajectory:
        z = np.zeros(2, np.int32)
        return Trajectory("verifier", z, z.astype(np.float32), z.astype(np.uint8), z, z.astype(np.int8),
                          float(truth == accept), meta={"truth": truth, "accept": accept})

    def mean_reward(verdict: Callable[[bool], bool]) -> float:
        """Mean reward over 200 groups of 8 answers, 1 in 8 right, some groups all wrong."""
        prior, rng, rewards = ClassPrior(), np.random.default_rng(0), []
        for _ in range(200):
            truths = rng.random(8) < 1 / 8
            group = balance([judged(bool(t), verdict(bool(t))) for t in truths], "verifier", prior)
            rewards += [r.reward for r in group]
        return float(np.mean(rewards))

    assert mean_reward(lambda truth: False) == pytest.approx(0.5, abs=0.03)  # always reject
    assert mean_reward(lambda truth: True) == pytest.approx(0.5, abs=0.03)  # always accept
    assert mean_reward(lambda truth: truth) == pytest.approx(1.0, abs=0.03)  # a perfect judge
    assert mean_reward(lambda truth: not truth) == pytest.approx(0.0, abs=0.03)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """A tiny model warmed up on the tool format: it calls the tool, then copies its output."""
    cfg = parse_config("tasks: {kind: arithmetic, operands: 3, max_operand: 9, ops: '+', warmup: 150, "
                       "workflow: multi_turn_tool}\nwarmup: {steps: 300, lr: 0.003}\n"
                       "policies: [{name: agent, role: agent}]\n")
    source = TaskSource(cfg.tasks)
    model = make_model("qwen2", "tiny", tmp_path_factory.mktemp("a") / "model",
                       corpus=source.corpus())
    warm_up(model, cfg, "agent")
    e = hf_engine(model)
    yield e, source.warmup[0]
    e.close()


@contextlib.contextmanager
def env_server() -> Iterator[tuple[subprocess.Popen, str]]:
    """A real environment server process and its URL; killed and reaped afterwards."""
    with subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "env-server", "--max-turns", "2"],
                          stdout=subprocess.PIPE, text=True, cwd=REPO) as proc:
        try:
            yield proc, proc.stdout.readline().strip()
        finally:
            proc.kill()


@pytest.mark.skipif(Sandbox.check() is not None, reason=str(Sandbox.check()))
def test_agent_calls_the_sandboxed_tool_and_is_rewarded_by_the_environment(agent):
    engine, item = agent
    with env_server() as (_, url):
        ctx = context(engine, {"agent": engine}, {"agent": "agent"}, max_turns=3)
        ctx.params, ctx.policy_index = SamplingParams(12, 0.0, stop=engine.tok.stop_ids), {"agent": 0}
        ctx.environment, ctx.tools = EnvironmentClient(url), Sandbox()

        async def episode() -> list:
            try:
                return await multi_turn_tool(Task(1, 30.0, item.prompt, item.answer, 1, ["agent"]), ctx)
            finally:
                await ctx.environment.close()

        (record,) = asyncio.run(episode())
    assert record.meta["tool_calls"] >= 1 and record.meta["done"] and record.reward == 1.0
    text = engine.tok.decode(record.tokens)
    assert f">{item.answer};" in text  # the tool's output, from the sandbox
    tool = engine.tok.encode_text(f">{item.answer};")
    start = next(i for i in range(len(record.tokens)) if record.tokens[i:i + len(tool)].tolist() == tool)
    assert (record.loss_mask[start:start + len(tool)] == 0).all()  # tool output is never trained on
    assert trained_owner(record) == {0}


def test_environment_server_dying_mid_episode_is_an_episode_error(agent):
    engine, item = agent
    with env_server() as (proc, url):
        client = EnvironmentClient(url)

        async def episode() -> None:
            try:
                episode_id, _ = await client.start(Task(1, 30.0, item.prompt, item.answer, 1, ["agent"]))
                proc.kill()
                proc.wait()
                await client.step(episode_id, "9")
            finally:
                await client.close()

        with pytest.raises(EpisodeError, match="/step"):
            asyncio.run(episode())
