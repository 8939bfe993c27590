"""Inference engines behind one async interface. Registries: `ENGINES` (explicit table) and
`LIBRARIES`: each engine's library import, seconds for vLLM, which a worker does first
(`import_library`), while its run's model may still be being prepared.

OpenMP threads: an engine process runs `engine.threads` of them (default 1). OpenMP reads
`OMP_NUM_THREADS` once, when torch loads, and every thread that runs a batch (asyncio's
executor threads) starts from that count, whatever `torch.set_num_threads` the building thread
called; vLLM's CPU attention also checks, in every call, that a batch's thread has the count
the building thread had. So the count goes into the environment before the import. Why 1:
with torch's default (one per core) the engine's batches took 75-127 ms instead of 40-48 ms
(tiny model, 128 sequences) while another process kept one of the 2 cores busy, as the
trainer does; alone, both counts ran at ~40 ms.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable

from astraflow.config.schema import EngineConfig
from astraflow.heap import long_lived
from astraflow.rollout.engines.base import Engine


def _hf(model_dir: str, **kw) -> Engine:
    from astraflow.rollout.engines.hf import HFEngine

    return HFEngine(model_dir, **kw)


def _vllm(model_dir: str, **kw) -> Engine:
    from astraflow.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(model_dir, **kw)


def _vllm_batch(model_dir: str, **kw) -> Engine:
    from astraflow.rollout.engines.vllm_batch import VLLMBatchEngine

    return VLLMBatchEngine(model_dir, **kw)


ENGINES: dict[str, Callable[..., Engine]] = {"hf": _hf, "vllm": _vllm, "vllm-batch": _vllm_batch}


def _hf_library() -> None:
    importlib.import_module("astraflow.rollout.engines.hf")  # torch and transformers


def _vllm_library() -> None:
    from astraflow.rollout.engines.vllm_requests import import_vllm

    import_vllm()


LIBRARIES: dict[str, Callable[[], None]] = {"hf": _hf_library, "vllm": _vllm_library, "vllm-batch": _vllm_library}


def import_library(cfg: EngineConfig) -> None:
    """Import `cfg.kind`'s library with `cfg.threads` OpenMP threads (unless the environment
    sets them), its objects out of the collector's sight (`heap.long_lived`)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    with long_lived():
        LIBRARIES[cfg.kind]()
