"""`rlvr`: single-turn RL with verifiable rewards. One prompt, `group_size` sampled answers,
each scored by the task's reward function against the reference answer (one GRPO group).

With `workflow.reference_guidance`, a group whose answers all scored 0 gets the reference
answer (the task's worked solution where it has one) as one more record (meta `guided:
true`): its tokens are forced, its logprobs are the engine's for those tokens under the same
sampling distribution, so the trainer's importance correction treats it like a sample the
policy happened to draw.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from astraflow.protocol.messages import Task, Trajectory
from astraflow.workflows.api import EpisodeContext, Sequence


async def rlvr(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    policy = ctx.roles["policy"]
    engine = ctx.engines[policy]
    prompt = ctx.prompt_ids(task)

    async def one(forced: tuple[int, ...] = ()) -> Trajectory:
        t0 = time.perf_counter()
        params = dataclasses.replace(ctx.sampling(), forced=forced) if forced else ctx.sampling()
        completion = await engine.generate(prompt, params)
        text = ctx.tokenizer.decode(completion.tokens)
        reward = await ctx.score(text, task)
        seq = Sequence(prompt)
        seq.add_completion(ctx.policy_index[policy], completion)
        meta = {"completion": text, "guided": True} if forced else {"completion": text}
        return seq.record(policy, ctx.policy_index[policy], reward, group_id=task.task_id,
                          episode_id=ctx.episode_id(), gen_s=time.perf_counter() - t0, meta=meta)

    group = list(await asyncio.gather(*(one() for _ in range(task.group_size))))
    if ctx.workflow.reference_guidance and not any(t.reward > 0 for t in group):
        group.append(await one(tuple(ctx.tokenizer.encode_completion(task.target))))
    return group
