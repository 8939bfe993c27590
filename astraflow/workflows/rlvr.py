"""`rlvr`: single-turn RL with verifiable rewards. One prompt, `group_size` sampled answers,
each scored by the task's reward function against the reference answer (one GRPO group)."""
from __future__ import annotations

import asyncio
import time

from astraflow.protocol.messages import Task, Trajectory
from astraflow.workflows.api import EpisodeContext, Sequence


async def rlvr(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    policy = ctx.roles["policy"]
    engine = ctx.engines[policy]
    prompt = ctx.codec.encode_prompt(task.prompt)

    async def one() -> Trajectory:
        t0 = time.perf_counter()
        completion = await engine.generate(prompt, ctx.sampling())
        text = ctx.codec.decode(completion.tokens)
        seq = Sequence(prompt)
        seq.add_completion(ctx.policy_index[policy], completion)
        return seq.record(policy, ctx.policy_index[policy], ctx.reward(text, task.answer), group_id=task.task_id,
                          episode_id=ctx.episode_id(), gen_s=time.perf_counter() - t0, meta={"completion": text})

    return list(await asyncio.gather(*(one() for _ in range(task.group_size))))
