"""Workflows: async functions of (task, episode context) returning trajectories with rewards.

Registries are explicit tables: `WORKFLOWS` here (the roles each one needs are
`astraflow.config.schema.WORKFLOW_ROLES`), `REWARDS` in `rewards.py`. Each workflow also says
how to warm a policy up for each of its roles (supervised pairs on the role's format).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from astraflow.config.schema import Config
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.protocol.messages import Task, Trajectory
from astraflow.tasks.sources import Item
from astraflow.workflows import cotrain, search_agent, tool_agent
from astraflow.workflows.code import code
from astraflow.workflows.api import EpisodeContext, EpisodeError
from astraflow.workflows.rlvr import rlvr

WarmupExamples = Callable[[str, list[Item], ModelTokenizer, np.random.Generator, Config],
                          list[tuple[list[int], list[int]]]]


@dataclass(frozen=True)
class WorkflowSpec:
    run: Callable[[Task, EpisodeContext], Awaitable[list[Trajectory]]]
    warmup: WarmupExamples


def answer_examples(role: str, items: list[Item], tokenizer: ModelTokenizer, rng: np.random.Generator, cfg: Config
                    ) -> list[tuple[list[int], list[int]]]:
    return cotrain.warmup_examples("solver", items, tokenizer, rng, cfg)


WORKFLOWS: dict[str, WorkflowSpec] = {
    "rlvr": WorkflowSpec(rlvr, answer_examples),
    "solver_verifier": WorkflowSpec(cotrain.solver_verifier, cotrain.warmup_examples),
    "solve_and_check": WorkflowSpec(cotrain.solve_and_check, cotrain.warmup_examples),
    "multi_turn_tool": WorkflowSpec(tool_agent.multi_turn_tool, tool_agent.warmup_examples),
    "code": WorkflowSpec(code, answer_examples),
    "search": WorkflowSpec(search_agent.search, search_agent.warmup_examples),
}

__all__ = ["WORKFLOWS", "EpisodeContext", "EpisodeError", "WorkflowSpec"]
