"""`code`: the policy writes code; the reward is the fraction of the task's hidden unit tests
that pass in the sandbox (`grading.py`); with `workflow.max_turns > 1`, the first failing
test comes back and the policy tries again.

A task's row holds `tests` (assert statements) and optionally `prefix` (the code a
completion continues: the problem's signature, `tasks/code_problems.py`). Per group member:
generate, grade `prefix + completion` (or the completion's last ```python block); while a
test fails and turns remain, append the failure as context — a user turn through the chat
template, else a comment line and the prompt's indentation, so that the next completion is
again a body — and generate again. The reward is the last attempt's fraction: a multi-turn
episode is rewarded for where it ended. Meta: the last completion, passed/total tests, the
turns taken and the failure's reason (None when all passed), so a run's shards say why each
episode lost reward.

With `workflow.reference_guidance`, a group whose attempts all scored 0 gets the reference
body as one more member, scored by the engine (`guided`, as in `rlvr`).

The record is the whole exchange; only the policy's tokens are trained (feedback is
context). Grading runs under `grading.LIMITS`, in a sandbox that hides the worker's run directory
(as every sandbox in a worker does: `sandbox.hide_in_every_sandbox`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from astraflow.protocol.messages import Task, Trajectory
from astraflow.sandbox import Sandbox
from astraflow.workflows.api import EpisodeContext, Sequence
from astraflow.workflows.grading import LIMITS, Grader, solution_code

INDENT = "    "


def feedback(reason: str, chat: bool) -> str:
    """The text after a failed attempt: the failure, then where the next attempt starts."""
    return f"Failed: {reason}" if chat else f"\n{INDENT}# failed: {reason}\n{INDENT}"


async def code(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    policy = ctx.roles["policy"]
    index, engine = ctx.policy_index[policy], ctx.engines[policy]
    grader = ctx.state.get("grader")
    if grader is None:
        grader = ctx.state["grader"] = Grader(Sandbox(LIMITS))
    tests, prefix = list(task.row.get("tests") or []), str(task.row.get("prefix", ""))
    chat = ctx.tokenizer.chat and ctx.tokenizer.has_chat_template

    async def one(forced: tuple[int, ...] = ()) -> Trajectory:
        t0 = time.perf_counter()
        seq = Sequence(ctx.prompt_ids(task))
        turns = 1 if forced else max(1, ctx.workflow.max_turns)
        for turn in range(1, turns + 1):
            params = dataclasses.replace(ctx.sampling(), forced=forced) if forced else ctx.sampling()
            completion = await engine.generate(seq.ids, params)
            seq.add_completion(index, completion)
            text = ctx.tokenizer.decode(completion.tokens)
            result = await grader(solution_code(text, prefix), tests)
            if result.reason is None or turn == turns:
                break
            seq.add_context(ctx.tokenizer.encode_turns([{"role": "user", "content": feedback(result.reason, chat)}],
                                                       completion.finished))
        meta = {"completion": text, "passed": result.passed, "tests": len(tests), "turns": turn,
                "reason": result.reason, **({"guided": True} if forced else {})}
        return seq.record(policy, index, result.fraction, task.task_id, ctx.episode_id(), time.perf_counter() - t0,
                          meta)

    group = list(await asyncio.gather(*(one() for _ in range(task.group_size))))
    if ctx.workflow.reference_guidance and not any(t.reward > 0 for t in group):
        group.append(await one(tuple(ctx.tokenizer.encode_completion(task.target))))
    return group
