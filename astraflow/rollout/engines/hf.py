"""The `hf` engine: a transformers model with its own sampling loop, batched across
concurrent episodes (the light fallback engine).

The loop (prefill with a KV cache, then one token per step; temperature, no top-k/top-p) is
what `generate` does for these settings, without its per-call set-up: 14 vs 17 ms for a
batch of 128 quickstart prompts of 3 tokens on the tiny model.
Logprobs are log_softmax(logits / T) of the sampled token: the distribution sampled from.
Prompts are left-padded; positions count only real tokens, as the trainer's forward does.
A request ends at any of its stop ids (`SamplingParams.stop`).

Device and dtype follow the process (`astraflow.hardware`: the GPU Slurm or torchrun
assigns, bf16 there; the CPU in fp32). A published version is loaded with `strict` name
checks (tensors are copied into the model's own parameters, in its dtype; after a delta only
the tensors it changed); a tied `lm_head`, which
publication writes once under the embedding's name, is the embedding again after the load.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from astraflow import hardware
from astraflow.rollout.engines.base import Completion, SamplingParams, stop_cut
from astraflow.rollout.engines.batching import BatchingEngine

PAD = 0  # left padding is masked out, so any id serves


class HFEngine(BatchingEngine):
    def __init__(self, model_dir: str | Path, max_batch: int = 256, threads: int | None = None, seed: int = 0,
                 batch_wait_s: float = 0.0, dtype: str = "auto", **_: object) -> None:
        super().__init__(max_batch, batch_wait_s)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.device = hardware.device()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hardware.compute_dtype(dtype, self.device))
        self.model.to(self.device).eval()

    def install(self, weights: dict, changed: frozenset[str] | None = None) -> None:
        if changed is not None:  # a delta: only the tensors it changed are copied into the parameters
            weights = {name: weights[name] for name in changed}
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or (changed is None and set(missing) - tied):
            raise ValueError(f"weights do not fit the model: missing {sorted(set(missing) - tied)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        if tied:
            self.model.tie_weights()

    # ---------------------------------------------------------------- batch
    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        dev = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        temperature = params[0].temperature
        greedy = temperature <= 0
        limit = torch.tensor([len(p.forced) or p.max_tokens for p in params], device=dev)
        forced = torch.full((len(prompts), int(limit.max())), -1, dtype=torch.long)
        for i, p in enumerate(params):
            if p.forced:  # rare (a reference answer): the common batch pays no per-request copy
                forced[i, : len(p.forced)] = torch.tensor(p.forced, dtype=torch.long)
        forced = forced.to(dev)
        stop_ids = torch.tensor(sorted({s for p in params for s in p.stop}) or [-1], device=dev)
        stops = torch.tensor([bool(p.stop) and not p.ignore_eos for p in params], device=dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
        steps, logps = [], []
        for step in range(int(limit.max())):
            logp = torch.log_softmax(out.logits[:, -1].float() / (1.0 if greedy else temperature), dim=-1)
            token = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1)[:, 0]
            token = torch.where(forced[:, step] >= 0, forced[:, step], token).masked_fill(done, PAD)
            steps.append(token)
            logps.append(logp.gather(-1, token[:, None])[:, 0])
            done |= (stops & torch.isin(token, stop_ids)) | (limit <= step + 1)
            if done.all():
                break
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype, device=dev)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                             past_key_values=out.past_key_values, use_cache=True)
        new = torch.stack(steps, dim=1).cpu()
        lp = torch.stack(logps, dim=1).float().cpu()
        results = []
        for i, p in enumerate(params):
            row = new[i, : int(limit[i])].numpy()
            n, finished = stop_cut(row, p.stop)
            results.append(Completion(row[:n].astype(np.int32), lp[i, :n].numpy().astype(np.float32),
                                      self.version, finished, len(row) if p.ignore_eos else n))
        return results
