"""The `vllm-batch` engine: vLLM's offline `LLM.generate`, batch-synchronous (`BatchingEngine`):
requests that arrive while a batch runs wait for it, and a batch lasts as long as its longest
generation. Kept beside the continuous `vllm` engine as the baseline `astraflow bench rollout`
measures it against, and as a fallback.

New weights are loaded in place between batches: on CPU by `vllm_swap` (a third of the time of
vLLM's own `collective_rpc("reload_weights")`); elsewhere a model directory goes through
`reload_weights` and an in-memory state dict (the weight channel's) through the model's own
`load_weights` in each vLLM worker (`vllm_swap.WorkerExtension`: no loader round trip).
Identical requests in a batch (the members of a group) go to vLLM as one request for n samples.
Requests and outputs convert as `vllm_requests` describes.

The engine core runs in this process, and two of them must never run at once: a worker of two
policies (solver + verifier) holds one engine each, and their batches, each in a thread, ran
concurrently until the process died ("corrupted double-linked list") or hung inside a oneDNN
GEMM. `IN_PROCESS` serialises every call into any in-process vLLM engine; on a CPU the two
shared the same cores anyway.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from astraflow.rollout.engines import vllm_swap
from astraflow.rollout.engines.base import Completion, SamplingParams
from astraflow.rollout.engines.batching import BatchingEngine
from astraflow.rollout.engines.vllm_requests import (engine_settings, import_vllm, prefix_cache_emptied, sampled,
                                                     scored, swap_call, vllm_params)

IN_PROCESS = threading.Lock()


class VLLMBatchEngine(BatchingEngine):
    def __init__(self, model_dir: str | Path, max_batch: int = 256, threads: int | None = None, seed: int = 0,
                 batch_wait_s: float = 0.0, dtype: str = "auto", max_model_len: int = 0,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 enforce_eager: bool | None = None) -> None:
        super().__init__(max_batch, batch_wait_s)
        import_vllm()
        # `threads` reaches vLLM through OMP_NUM_THREADS, set before torch loads (`engines.import_library`)
        from vllm import LLM

        self.llm = LLM(**engine_settings(model_dir, max_batch, seed, dtype, max_model_len, gpu_memory_utilization,
                                         tensor_parallel_size, enforce_eager))
        self.swap_in_place = vllm_swap.applies(tensor_parallel_size)

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        # identical requests (a group's members) become one request for n samples: vLLM's
        # per-request input processing, not the model, dominates a batch of a tiny model
        same: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            same.setdefault((tuple(prompt), p), []).append(i)
        inputs = [TokensPrompt(prompt_token_ids=[*prompt, *p.forced]) for prompt, p in same]
        with IN_PROCESS:
            outs = self.llm.generate(inputs, [vllm_params(p, len(ids)) for (_, p), ids in same.items()],
                                     use_tqdm=False)
        results: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
        for ((prompt, p), ids), out in zip(same.items(), outs):
            if p.forced:  # scoring is deterministic: one result serves every copy
                one = scored(out.prompt_logprobs[len(prompt):], p, self.version)
                for i in ids:
                    results[i] = one
            else:
                for i, sample in zip(ids, out.outputs):
                    results[i] = sampled([(sample, self.version)], p)
        return results

    def read_weights(self, path: Path) -> dict | Path:
        """The tensors for an in-place swap; vLLM's `reload_weights` reads the directory itself."""
        return super().read_weights(path) if self.swap_in_place else path

    def install(self, weights: dict | Path, changed: frozenset[str] | None = None) -> None:
        # the worker is in this process unless the environment moved vLLM's engine core out
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        method, kwargs = swap_call(weights, changed, self.swap_in_place, pack=not in_process)
        with IN_PROCESS:
            vllm_swap.refused(self.llm.collective_rpc(method, kwargs=kwargs))
            prefix_cache_emptied(self.llm.reset_prefix_cache())  # its blocks hold the old weights' keys and values
