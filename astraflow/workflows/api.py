"""What a workflow gets and how it builds records: engines per policy, roles, the tokenizer,
sampling, the reward, and (for agentic workflows) an environment client, a tool sandbox and
the task source's config (where a search agent's corpus comes from).

A workflow is `async def wf(task: Task, ctx: EpisodeContext) -> list[Trajectory]`. It may call
`ctx.engines[policy].generate(...)` as often as it likes (multi-turn, several policies);
the engine batches concurrent episodes. Text becomes ids only through `ctx.tokenizer` (the
model directory's tokenizer and chat template: `ModelTokenizer`), and completions are
scored with `await ctx.score(text, task)`. Records are built with `Sequence`: every segment is
either context (prompt, tool output, environment observation: loss_mask 0, token_policy -1,
version -1) or one policy's completion. A record is the sequence as seen by one policy:
its loss mask covers exactly the tokens that policy generated — another policy's tokens and
tool output are never trained on.

Free-form `meta` travels with a record into the shards; one key has a meaning to the system:
`guided: true` marks a record that is not the policy's own sampling of the episode (a
reference answer whose tokens the engine scored; a verifier's verdict on an answer the
solver did not give): trained, but never counted as generated reward.

An environment or tool that fails raises `EpisodeError`: the worker hands the task back to
be leased again instead of crashing.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from astraflow.config.schema import TaskSourceConfig, WorkflowConfig
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.protocol.messages import Task, Trajectory
from astraflow.rollout.engines.base import Completion, Engine, SamplingParams

Z99 = 2.3263  # the standard normal's 99th percentile


class EpisodeError(Exception):
    """An environment or tool failed mid-episode: the task goes back to the queue. `kind`
    names the failure for the worker's count of them (environments/client.py: KINDS)."""

    def __init__(self, message: str, kind: str = "environment") -> None:
        super().__init__(message)
        self.kind = kind


def lognormal(rng: np.random.Generator, median: float, p99: float) -> float:
    """A draw from the lognormal with this median and 99th percentile."""
    sigma = math.log(max(p99, median) / median) / Z99
    return float(median * math.exp(sigma * rng.standard_normal()))


@dataclass
class EpisodeContext:
    engines: dict[str, Engine]
    tokenizer: ModelTokenizer
    params: SamplingParams
    reward: Callable[..., Awaitable[float]]  # a `workflows.rewards.Scorer`: (completion, answer, row)
    policy_index: dict[str, int]
    rng: np.random.Generator
    roles: dict[str, str]  # role -> policy
    workflow: WorkflowConfig = WorkflowConfig()
    tasks: TaskSourceConfig = TaskSourceConfig()  # search: where its corpus comes from
    environment: Any = None  # astraflow.environments.client.EnvironmentClient
    tools: Any = None  # astraflow.sandbox.Sandbox
    # what a workflow carries from episode to episode within this worker (cotrain: the
    # running class frequency of the answers its verifier judges)
    state: dict[str, Any] = field(default_factory=dict)

    def sampling(self) -> SamplingParams:
        """The episode's sampling parameters; with `decode_len_median` set, a long-tailed length."""
        w = self.workflow
        if w.decode_len_median <= 0:
            return self.params
        n = lognormal(self.rng, w.decode_len_median, w.decode_len_median * w.decode_len_p99_ratio)
        return dataclasses.replace(self.params, max_tokens=max(1, min(self.params.max_tokens, round(n))),
                                   ignore_eos=True)

    def episode_id(self) -> int:
        return int(self.rng.integers(1 << 62))

    async def score(self, completion: str, task: Task) -> float:
        return await self.reward(completion, task.answer, task.row)

    def prompt_ids(self, task: Task) -> list[int]:
        """The task's prompt as ids: its chat messages, or its text (through the template when configured)."""
        return self.tokenizer.encode_prompt(task.prompt, task.messages)


class Sequence:
    """A token sequence built segment by segment, from which per-policy records are cut."""

    def __init__(self, context: list[int]) -> None:
        self.tokens: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.owner: list[np.ndarray] = []
        self.versions: list[np.ndarray] = []
        self.add_context(context)

    def add_context(self, ids: list[int]) -> None:
        n = len(ids)
        self.tokens.append(np.asarray(ids, np.int32))
        self.logprobs.append(np.zeros(n, np.float32))
        self.owner.append(np.full(n, -1, np.int8))
        self.versions.append(np.full(n, -1, np.int32))

    def add_completion(self, policy_index: int, completion: Completion) -> None:
        n = len(completion.tokens)
        self.tokens.append(np.asarray(completion.tokens, np.int32))
        self.logprobs.append(np.asarray(completion.logprobs, np.float32))
        self.owner.append(np.full(n, policy_index, np.int8))
        self.versions.append(completion.token_versions())

    @property
    def ids(self) -> list[int]:
        return np.concatenate(self.tokens).tolist()

    def record(self, policy: str, policy_index: int, reward: float, group_id: int, episode_id: int,
               gen_s: float, meta: dict) -> Trajectory:
        owner = np.concatenate(self.owner)
        return Trajectory(policy=policy, tokens=np.concatenate(self.tokens), logprobs=np.concatenate(self.logprobs),
                          loss_mask=(owner == policy_index).astype(np.uint8), versions=np.concatenate(self.versions),
                          token_policy=owner, reward=reward, episode_id=episode_id, group_id=group_id, gen_s=gen_s,
                          meta=meta)
