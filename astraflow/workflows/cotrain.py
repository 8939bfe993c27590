"""Two policies in one episode: a solver answers, a verifier judges the answer.

- `solver_verifier`: the solver's record is (question, answer); the verifier's is (question,
  answer, "?", judgment) with the answer as context it did not generate. The solver is
  rewarded by correctness, the verifier by judging correctly (accept a right answer, reject
  a wrong one), weighted by the class of the answer so that its mean reward is its balanced
  accuracy (`balance`): always-reject and always-accept score 0.5 (`meta.truth`,
  `meta.accept` per record). With `workflow.retry` the solver answers once more after a
  rejection (both attempts are records of its group). With `workflow.verifier_contrast`
  every group shows the verifier both classes: when none of the solver's answers was right
  it also judges the reference answer, when none was wrong a drawn wrong one
  (`wrong_answer`). Without that, the verdict could be read off the question (a solver
  that never gets a sum right makes "reject every answer to that sum" score).
  Those judgments are sampled, but of answers the solver did not give: `guided` records,
  trained on and not counted in the verifier's reward, which stays its balanced accuracy
  on the solver's answers. With `workflow.reference_guidance`, a group whose answers all
  scored 0 also gets the reference answer as the solver's, scored by its engine (`guided`,
  as in `rlvr`).
- `solve_and_check`: the same exchange as one concatenated sequence with a per-token policy
  mask: both policies' records are the whole sequence; each trains only its own tokens.

The verifier's context is token for token the same in both: the question, the solver's
tokens (its stop token included when it stopped), then "?" (as a user turn of the chat
template when prompts go through one); it answers "Y" or "N".
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from dataclasses import replace

import numpy as np

from astraflow.config.schema import Config
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.protocol.messages import Task, Trajectory
from astraflow.rollout.engines.base import Completion
from astraflow.tasks.sources import Item
from astraflow.workflows.api import EpisodeContext, Sequence

ASK = "?"


def accepted(text: str) -> bool:
    return text.strip()[:1] == "Y"


def judge_context(tokenizer: ModelTokenizer, question_ids: list[int], answer_ids: list[int], ended: bool = True
                  ) -> list[int]:
    """What the verifier sees: the question, the answer (`ended`: with its stop token), "?"."""
    return [*question_ids, *answer_ids, *ask(tokenizer, ended)]


def ask(tokenizer: ModelTokenizer, ended: bool) -> list[int]:
    return tokenizer.encode_turns([{"role": "user", "content": ASK}], ended)


async def _exchange(task: Task, ctx: EpisodeContext, concatenated: bool) -> list[Trajectory]:
    solver, verifier = ctx.roles["solver"], ctx.roles["verifier"]
    si, vi = ctx.policy_index[solver], ctx.policy_index[verifier]
    question = ctx.prompt_ids(task)

    async def judge(answer_ids: list[int], ended: bool) -> tuple[Sequence, Completion, bool]:
        """The verifier's judgment of an answer: its own sequence (question, answer, "?",
        verdict), the verdict, and whether it accepted."""
        seq = Sequence(judge_context(ctx.tokenizer, question, answer_ids, ended))
        judged = await ctx.engines[verifier].generate(seq.ids, ctx.sampling())
        seq.add_completion(vi, judged)
        return seq, judged, accepted(ctx.tokenizer.decode(judged.tokens))

    async def attempt(episode: int, n: int) -> tuple[list[Trajectory], bool]:
        t0 = time.perf_counter()
        answer = await ctx.engines[solver].generate(question, ctx.sampling())
        text = ctx.tokenizer.decode(answer.tokens)
        correct = await ctx.score(text, task) > 0.5
        if ctx.workflow.env_check:
            await ctx.environment.check(task, text)
        verifier_seq, judged, accept = await judge(answer.tokens.tolist(), answer.finished)
        gen_s = time.perf_counter() - t0
        meta = {"completion": text, "attempt": n, "truth": correct, "accept": accept}
        solver_seq = Sequence(question)
        solver_seq.add_completion(si, answer)
        if concatenated:  # one sequence, the verifier's verdict after the answer: both records
            solver_seq.add_context(ask(ctx.tokenizer, answer.finished))
            solver_seq.add_completion(vi, judged)
            verifier_seq = solver_seq
        records = [solver_seq.record(solver, si, float(correct), task.task_id, episode, gen_s, meta),
                   verifier_seq.record(verifier, vi, float(accept == correct), task.task_id, episode, gen_s, meta)]
        return records, accept

    async def one() -> list[Trajectory]:
        episode = ctx.episode_id()
        records, accept = await attempt(episode, 0)
        if ctx.workflow.retry and not accept:
            more, _ = await attempt(episode, 1)
            records += more
        return records

    async def contrast(candidate: str, truth: bool) -> Trajectory:
        """The verifier's judgment of an answer the solver did not give."""
        t0 = time.perf_counter()
        seq, _, accept = await judge(ctx.tokenizer.encode_completion(candidate), True)
        meta = {"completion": candidate, "attempt": -1, "truth": truth, "accept": accept, "guided": True}
        return seq.record(verifier, vi, float(accept == truth), task.task_id, ctx.episode_id(),
                          time.perf_counter() - t0, meta)

    async def reference() -> Trajectory:
        """The reference answer as the solver's, scored (not sampled) by its engine."""
        t0 = time.perf_counter()
        forced = tuple(ctx.tokenizer.encode_completion(task.target))
        answer = await ctx.engines[solver].generate(question, dataclasses.replace(ctx.sampling(), forced=forced))
        seq = Sequence(question)
        seq.add_completion(si, answer)
        meta = {"completion": task.target, "attempt": -1, "truth": True, "guided": True}
        return seq.record(solver, si, 1.0, task.task_id, ctx.episode_id(), time.perf_counter() - t0, meta)

    records = [r for g in await asyncio.gather(*(one() for _ in range(task.group_size))) for r in g]
    # the loader allows these two for solver_verifier only
    if ctx.workflow.reference_guidance and not concatenated and not any(
            r.reward > 0 for r in records if r.policy == solver):
        records.append(await reference())
    if ctx.workflow.verifier_contrast and not concatenated:
        truths = [r.meta["truth"] for r in records if r.policy == verifier]
        if not any(truths):
            records.append(await contrast(task.target, True))
        if all(truths):
            records.append(await contrast(written_wrong(Item(task.prompt, task.answer, task.solution), ctx.rng), False))
    return balance(records, verifier, ctx.state.setdefault("verifier_class_prior", ClassPrior()))


class ClassPrior:
    """How often the answers a verifier judges are right, over this worker's last `window`
    judgments, kept within [0.05, 0.95]: no class weight exceeds 10, even while the solver
    is almost never (or always) right."""

    def __init__(self, window: int = 2048) -> None:
        self.window = window
        self.recent: deque[bool] = deque()
        self.right = 0  # of `recent`

    def observe(self, truths: list[bool]) -> float:
        for truth in truths:
            self.recent.append(truth)
            self.right += truth
            if len(self.recent) > self.window:
                self.right -= self.recent.popleft()
        return min(0.95, max(0.05, self.right / len(self.recent))) if self.recent else 0.5


def balance(records: list[Trajectory], verifier: str, prior: ClassPrior) -> list[Trajectory]:
    """Weight the verifier's rewards by class, 1/(2p) for a right answer and 1/(2(1-p)) for a
    wrong one, p the running frequency of right answers: the mean reward over many groups is
    then its balanced accuracy, so always-reject earns 0.5, not the 0.85 of plain accuracy
    while 15% of answers are right. (Unweighted, the tiny verifier learned to reject
    everything: balanced accuracy 0.63 -> 0.50 in 250 steps. Weighted within each group
    instead, a group of only wrong answers was plain accuracy, and the reported reward rose
    with rejecting everything.) Within a group, GRPO's normalisation removes the scale, so a
    group of one class learns as if unweighted; a mixed group's minority answers count more."""
    judged = [r for r in records if r.policy == verifier and not r.meta.get("guided")]
    p = prior.observe([r.meta["truth"] for r in judged])  # the solver's answers only
    weight = {True: 1 / (2 * p), False: 1 / (2 * (1 - p))}
    return [replace(r, reward=r.reward * weight[r.meta["truth"]]) if r.policy == verifier else r for r in records]


async def solver_verifier(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    return await _exchange(task, ctx, concatenated=False)


async def solve_and_check(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    return await _exchange(task, ctx, concatenated=True)


def wrong_answer(item: Item, rng: np.random.Generator) -> str:
    """A wrong answer: for a number a, one drawn uniformly from [0, 2a + 10) without a (near
    misses only, ±1 or ±2, taught the tiny verifier nothing: 0.50 balanced accuracy after
    1,500 supervised steps, against 0.65 after 100 with these); else a mangled string."""
    try:
        a = int(item.answer)
    except ValueError:
        return item.answer[::-1] + "x"
    c = int(rng.integers(0, 2 * abs(a) + 9))
    return str(c if c < abs(a) else c + 1)


def written_wrong(item: Item, rng: np.random.Generator) -> str:
    """A wrong answer written as the solver is taught to write a right one (`item.target`,
    e.g. `\\boxed{7}` for the answer 7): the target with a `wrong_answer` in the answer's
    place, so that the verifier judges the form it will see, not a bare number."""
    wrong = wrong_answer(item, rng)
    return item.target.replace(item.answer, wrong) if item.answer and item.answer in item.target else wrong


def warmup_examples(role: str, items: list[Item], tokenizer: ModelTokenizer, rng: np.random.Generator,
                    cfg: Config) -> list[tuple[list[int], list[int]]]:
    """Supervised pairs (context ids, target ids) on the format of `role`."""
    if role == "solver":
        return [(tokenizer.encode_prompt(i.prompt, i.messages), tokenizer.encode_completion(i.target)) for i in items]
    pairs = []
    for item in items:
        for candidate, verdict in ((item.target, "Y"), (written_wrong(item, rng), "N")):
            context = judge_context(tokenizer, tokenizer.encode_prompt(item.prompt, item.messages),
                                    tokenizer.encode_completion(candidate))
            pairs.append((context, tokenizer.encode_completion(verdict)))
    return pairs
