"""What both vllm engines (continuous: `vllm.py`, batch-synchronous: `vllm_batch.py`) share:
vLLM's import with the CPU defaults, the engine's settings, AstraFlow's sampling parameters
as vLLM's, and vLLM's outputs as `Completion`s.

Token ids in, token ids out (`skip_tokenizer_init`): AstraFlow owns tokenization. Logprobs
are vLLM's *processed* logprobs — after temperature, the distribution the token was
actually sampled from (the default, raw logprobs, would be wrong for temperature != 1).
Forced tokens (a reference answer to score) go in as prompt tokens with prompt logprobs.
vLLM leaves prompt logprobs at temperature 1: at T = 1 the forced token's own logprob is what
is needed (`prompt_logprobs=0`); at any other T the whole vocabulary's are asked for and
re-tempered here (log_softmax(logprobs / T) equals log_softmax(logits / T)). That costs a
Python dict of the vocabulary per prompt position in vLLM's output processing: with a 4k
vocabulary and 80-token prompts it took most of a worker's time, so sample at T = 1 where
reference guidance meets a large vocabulary.

New weights empty vLLM's prefix cache (`prefix_cache_emptied`): vLLM keeps the KV blocks of
every full block of prompt it has seen, keyed by the tokens alone, and reuses them for any
later prompt that starts the same way. Across a weight version those blocks hold the old
weights' keys and values: a 256-token prompt seen before a swap was continued on the stale
cache, its logprobs 0.34 off the new weights' (a chat template's system prompt is such a
shared prefix for every request of a real run).

CPU defaults (each overridable by the environment): a 1 GiB KV cache, the offline engine's
core in its process (one fewer process on a small machine; the async engine's core runs in a
child process whatever this says), no OpenMP thread pinning (pinning vLLM's threads to every
core fights the trainer on the same machine), and no `torch.compile`: even with
`enforce_eager`, vLLM compiles its sampler's logprob gather with inductor on the first
batch, 2.4 s of it (the evaluation's first score: 2.5 → 0.12 s; batch times unchanged within
the machine's noise). Read when torch's dynamo config is first imported, which vLLM does.
"""
from __future__ import annotations

import importlib
import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.rollout.engines import vllm_swap
from astraflow.rollout.engines.base import Completion, SamplingParams, stop_cut

CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TORCH_COMPILE_DISABLE": "1"}


def import_vllm() -> None:
    """Import vLLM (seconds) with the CPU defaults in the environment, where it reads them."""
    import torch

    if not torch.cuda.is_available():
        for key, value in CPU_DEFAULTS.items():
            os.environ.setdefault(key, value)
    importlib.import_module("vllm.entrypoints.llm")  # `LLM` and what it imports
    importlib.import_module("vllm.v1.engine.async_llm")


def engine_settings(model_dir: str | Path, max_batch: int, seed: int, dtype: str, max_model_len: int,
                    gpu_memory_utilization: float, tensor_parallel_size: int,
                    enforce_eager: bool | None) -> dict:
    """vLLM's engine arguments (the same for `LLM` and `AsyncEngineArgs`)."""
    import torch

    gpu = torch.cuda.is_available()
    # vLLM's CPU kernels die with SIGILL in bf16 on this kind of machine: fp32 there, always
    dtype = ("bfloat16" if gpu else "float32") if dtype == "auto" or not gpu else dtype
    gpu_settings = dict(gpu_memory_utilization=gpu_memory_utilization) if gpu else {}
    return dict(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                enforce_eager=(not gpu) if enforce_eager is None else enforce_eager,
                max_model_len=max_model_len or None, tensor_parallel_size=tensor_parallel_size,
                logprobs_mode="processed_logprobs", max_num_seqs=max_batch, max_logprobs=-1,
                worker_extension_cls=vllm_swap.EXTENSION, **gpu_settings)


def vllm_params(p: SamplingParams, n: int = 1, **extra):
    """`p` as vLLM's sampling parameters for `n` samples (a forced request: one scoring pass)."""
    from vllm import SamplingParams as VSampling

    # skip_clone: vLLM deep-copies each request's parameters unless told these are its own
    return VSampling(n=1 if p.forced else n, temperature=max(0.0, p.temperature), top_k=0, top_p=1.0,
                     max_tokens=1 if p.forced else p.max_tokens, logprobs=0,
                     prompt_logprobs=(0 if p.temperature == 1.0 else -1) if p.forced else None,
                     stop_token_ids=[] if p.ignore_eos else list(p.stop), ignore_eos=p.ignore_eos,
                     detokenize=False, skip_clone=True, **extra)


def sampled(parts: list[tuple[Any, int]], p: SamplingParams, aborted: bool = False) -> Completion:
    """One sampled completion from vLLM's outputs of its parts, each generated under one
    version ((sample, version); more than one where a partial rollout resumed), cut after its
    first stop token (decoded past it with ignore_eos)."""
    decoded = np.asarray([t for sample, _ in parts for t in sample.token_ids], np.int32)
    n, finished = stop_cut(decoded, p.stop)
    steps = itertools.chain.from_iterable(sample.logprobs or [] for sample, _ in parts)
    logprobs = np.array([step[t].logprob for step, t in zip(itertools.islice(steps, n), decoded[:n].tolist())],
                        np.float32)
    versions = np.concatenate([np.full(len(sample.token_ids), v, np.int32) for sample, v in parts])[:n]
    last = parts[-1][1]  # versions only grow: the first token's differs from the last's, or none does
    mixed = n > 0 and versions[0] != last
    return Completion(decoded[:n], logprobs, last, finished, len(decoded), aborted, versions if mixed else None)


def scored(steps: list[dict], p: SamplingParams, version: int) -> Completion:
    """The forced tokens with their logprobs at temperature p.temperature."""
    t = p.temperature if p.temperature > 0 else 1.0
    tokens = np.asarray(p.forced, np.int32)
    finished = bool(tokens[-1] in p.stop)
    if t == 1.0:  # the tokens' own logprobs, as vLLM gives them
        own = np.array([step[token].logprob for step, token in zip(steps, p.forced)], np.float32)
        return Completion(tokens, own, version, finished, len(tokens))
    logprobs = []
    for step, token in zip(steps, p.forced):
        ids = np.fromiter(step.keys(), np.int64, len(step))
        tempered = np.fromiter((v.logprob for v in step.values()), np.float64, len(step)) / t
        tempered -= np.logaddexp.reduce(tempered)
        logprobs.append(tempered[ids == token][0])
    return Completion(tokens, np.asarray(logprobs, np.float32), version, finished, len(tokens))


def prefix_cache_emptied(emptied: bool) -> None:
    """After a weight swap: vLLM's `reset_prefix_cache` refuses (False) while requests hold
    cached blocks, and the engines swap only with none running, so a refusal is a bug here."""
    if not emptied:
        raise RuntimeError("vLLM refused to empty its prefix cache after a weight swap: requests were "
                           "still running, and their cached prompts hold the old weights' keys and values")


def swap_call(weights: dict | Path, changed: frozenset[str] | None, in_place: bool,
              pack: bool) -> tuple[str, dict]:
    """The worker method and its arguments that put `weights` (a state dict, or a model
    directory for vLLM's own `reload_weights`) in place; `pack`: the worker is in another
    process (`vllm_swap.pack`)."""
    if isinstance(weights, Path):
        return "reload_weights", {"weights_path": str(weights)}
    wire = vllm_swap.pack if pack else dict
    if in_place:  # whole tensors: q/k/v and gate/up are stacked together, all or none
        return "astraflow_swap", {"weights": wire(weights)}
    # the model's loader takes each checkpoint tensor on its own: only the changed ones
    subset = weights if changed is None else {name: weights[name] for name in changed}
    return "astraflow_load_named", {"weights": wire(subset)}
