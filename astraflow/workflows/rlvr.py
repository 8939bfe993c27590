"""`rlvr`: single-turn RL with verifiable rewards. One prompt, `group_size` sampled answers,
each scored by the task's reward function against the reference answer (one GRPO group)."""
from __future__ import annotations

import asyncio
import time

from astraflow.protocol.messages import Task, Trajectory
from astraflow.workflows.api import EpisodeContext, trajectory


async def rlvr(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    (policy,) = task.policies
    engine = ctx.engines[policy]
    prompt = ctx.codec.encode_prompt(task.prompt)

    async def one() -> Trajectory:
        t0 = time.perf_counter()
        completion = await engine.generate(prompt, ctx.params)
        text = ctx.codec.decode(completion.tokens)
        return trajectory(policy, ctx.policy_index[policy], prompt, completion, ctx.reward(text, task.answer),
                          group_id=task.task_id, episode_id=int(ctx.rng.integers(1 << 62)),
                          gen_s=time.perf_counter() - t0, meta={"completion": text})

    return list(await asyncio.gather(*(one() for _ in range(task.group_size))))
