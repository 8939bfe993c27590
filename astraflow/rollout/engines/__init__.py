"""Inference engines behind one async interface. Registry: `ENGINES` (explicit table)."""
from __future__ import annotations

from typing import Callable

from astraflow.rollout.engines.base import Engine


def _hf(model_dir: str, **kw) -> Engine:
    from astraflow.rollout.engines.hf import HFEngine

    return HFEngine(model_dir, **kw)


def _vllm(model_dir: str, **kw) -> Engine:
    from astraflow.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(model_dir, **kw)


ENGINES: dict[str, Callable[..., Engine]] = {"hf": _hf, "vllm": _vllm}
