"""Workflows: async functions of (task, episode context) returning trajectories with rewards.

Registries are explicit tables: `WORKFLOWS` here, `REWARDS` in `rewards.py`.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from astraflow.workflows.api import EpisodeContext
from astraflow.workflows.rlvr import rlvr

Workflow = Callable[..., Awaitable[list]]
WORKFLOWS: dict[str, Workflow] = {"rlvr": rlvr}

__all__ = ["WORKFLOWS", "EpisodeContext", "Workflow"]
