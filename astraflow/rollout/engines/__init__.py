"""Inference engines behind one async interface. Registries: `ENGINES` (explicit table) and
`LIBRARIES`: each engine's library import, seconds for vLLM, which a worker does first, while
its run's model may still be being prepared."""
from __future__ import annotations

import importlib
from typing import Callable

from astraflow.rollout.engines.base import Engine


def _hf(model_dir: str, **kw) -> Engine:
    from astraflow.rollout.engines.hf import HFEngine

    return HFEngine(model_dir, **kw)


def _vllm(model_dir: str, **kw) -> Engine:
    from astraflow.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(model_dir, **kw)


ENGINES: dict[str, Callable[..., Engine]] = {"hf": _hf, "vllm": _vllm}


def _hf_library() -> None:
    importlib.import_module("astraflow.rollout.engines.hf")  # torch and transformers


def _vllm_library() -> None:
    from astraflow.rollout.engines.vllm import import_vllm

    import_vllm()


LIBRARIES: dict[str, Callable[[], None]] = {"hf": _hf_library, "vllm": _vllm_library}
