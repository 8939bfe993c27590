"""`engines.import_library`: every thread that runs an engine's batches gets `engine.threads`
OpenMP threads, not only the thread that built the engine (measured in
`astraflow/rollout/engines/__init__.py`: batches twice as slow beside a busy core otherwise).
Checked in a fresh interpreter, because OpenMP reads its thread count once, when torch loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, sys, threading
from astraflow.config.schema import EngineConfig
from astraflow.rollout.engines import import_library

import_library(EngineConfig(kind="hf", threads=int(sys.argv[1])))
import torch

seen = []
worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # like asyncio.to_thread's
worker.start(); worker.join()
print(json.dumps({"batch_thread": seen[0]}))
"""


def clean_env() -> dict[str, str]:
    """This process's environment without an OpenMP thread count, and without the libgomp that
    an earlier test's vLLM import preloads for child processes (a preloaded OpenMP reads its
    thread count before `import_library` can set it)."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LD_PRELOAD")}


def run(threads: int, env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["batch_thread"]


def test_batch_threads_run_the_configured_openmp_threads() -> None:
    # without it a thread that did not build the engine gets torch's default, one per core
    assert run(1, clean_env()) == 1


def test_the_environment_overrides_the_config() -> None:
    assert run(1, {**clean_env(), "OMP_NUM_THREADS": "2"}) == min(2, os.cpu_count() or 1)  # torch caps at the cores
