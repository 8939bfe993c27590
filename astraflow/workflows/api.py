"""What a workflow gets: engines per policy, the text codec, sampling parameters, the reward.

A workflow is `async def wf(task: Task, ctx: EpisodeContext) -> list[Trajectory]`. It may call
`ctx.engines[policy].generate(...)` as often as it likes (multi-turn, several policies);
the engine batches concurrent episodes. Every token it did not generate with a policy's
engine gets loss_mask 0 and token_policy -1 (prompt, tool, environment output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from astraflow.models.tokenizer import TextCodec
from astraflow.protocol.messages import Trajectory
from astraflow.rollout.engines.base import Completion, Engine, SamplingParams


@dataclass
class EpisodeContext:
    engines: dict[str, Engine]
    codec: TextCodec
    params: SamplingParams
    reward: Callable[[str, str], float]
    policy_index: dict[str, int]
    rng: np.random.Generator


def trajectory(policy: str, policy_index: int, prompt: list[int], completion: Completion, reward: float,
               group_id: int, episode_id: int, gen_s: float, meta: dict) -> Trajectory:
    """A single-turn record: prompt tokens (not trained) followed by this policy's completion."""
    n_p, n_c = len(prompt), len(completion.tokens)
    return Trajectory(
        policy=policy,
        tokens=np.concatenate([np.asarray(prompt, np.int32), completion.tokens]),
        logprobs=np.concatenate([np.zeros(n_p, np.float32), completion.logprobs]),
        loss_mask=np.concatenate([np.zeros(n_p, np.uint8), np.ones(n_c, np.uint8)]),
        versions=np.concatenate([np.full(n_p, -1, np.int32), np.full(n_c, completion.version, np.int32)]),
        token_policy=np.concatenate([np.full(n_p, -1, np.int8), np.full(n_c, policy_index, np.int8)]),
        reward=reward, episode_id=episode_id, group_id=group_id, gen_s=gen_s, meta=meta)
