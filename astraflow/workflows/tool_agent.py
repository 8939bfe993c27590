"""`multi_turn_tool`: an agent that calls a tool and talks to an environment, turn by turn.

Per episode: the environment server starts an episode and gives the first observation (the
prompt). Each turn the agent generates; an action starting with "!" is a tool call — the rest
is a Python expression, evaluated in the sandbox, whose output comes back as context
">OUTPUT;" — anything else is an answer sent to the environment (`step`), which says whether
the episode is done and with what reward, or gives an observation for the next turn. Up to
`workflow.max_turns` agent turns; an unfinished episode is cancelled on the server.

The record is the whole interaction; only the agent's tokens are trained (tool output and
observations are context). Environment and tool failures raise `EpisodeError`.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from astraflow.config.schema import Config
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.protocol.messages import Task, Trajectory
from astraflow.tasks.sources import Item
from astraflow.workflows.api import EpisodeContext, Sequence

TOOL = "!"


def tool_output(text: str) -> str:
    return f">{text.strip()};"


async def multi_turn_tool(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    agent = ctx.roles["agent"]
    index, engine = ctx.policy_index[agent], ctx.engines[agent]

    async def one() -> Trajectory:
        t0 = time.perf_counter()
        episode, observation = await ctx.environment.start(task)
        seq = Sequence(ctx.tokenizer.encode_prompt(observation))
        reward, done, calls = 0.0, False, 0
        try:
            for _ in range(ctx.workflow.max_turns):
                completion = await engine.generate(seq.ids, ctx.sampling())
                seq.add_completion(index, completion)
                action = ctx.tokenizer.decode(completion.tokens)
                if action.startswith(TOOL):
                    calls += 1
                    result = await ctx.tools.run_python(f"print({action[len(TOOL):]})")
                    output = tool_output(result.stdout if result.ok else "error")
                    seq.add_context(ctx.tokenizer.encode_turns([{"role": "tool", "content": output}],
                                                               completion.finished))
                    continue
                observation, reward, done = await ctx.environment.step(episode, action)
                if done:
                    break
                seq.add_context(ctx.tokenizer.encode_turns([{"role": "user", "content": observation}],
                                                           completion.finished))
        finally:
            if not done:
                await ctx.environment.cancel(episode)
        return seq.record(agent, index, reward, task.task_id, ctx.episode_id(), time.perf_counter() - t0,
                          {"tool_calls": calls, "done": done})

    return list(await asyncio.gather(*(one() for _ in range(task.group_size))))


def warmup_examples(role: str, items: list[Item], tokenizer: ModelTokenizer, rng: np.random.Generator,
                    cfg: Config) -> list[tuple[list[int], list[int]]]:
    """The tool-use format: call the tool with the prompt's expression, then copy its output."""
    pairs = []
    for item in items:
        question = tokenizer.encode_prompt(item.prompt)
        call = tokenizer.encode_completion(TOOL + item.prompt.rstrip("="))
        output = tokenizer.encode_turns([{"role": "tool", "content": tool_output(item.answer)}], True)
        pairs.append((question, call))
        pairs.append(([*question, *call, *output], tokenizer.encode_completion(item.answer)))
    return pairs
