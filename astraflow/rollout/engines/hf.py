"""The `hf` engine: transformers `generate`, batched across concurrent episodes (the light
fallback engine). Logprobs come from the raw logits of each sampled step (`output_logits`),
scaled by the temperature exactly as sampling did.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from astraflow.models.tokenizer import TextCodec
from astraflow.rollout.engines.base import Completion, SamplingParams
from astraflow.rollout.engines.batching import BatchingEngine
from astraflow.weights.fs import load_state_dict


class HFEngine(BatchingEngine):
    def __init__(self, model_dir: str | Path, max_batch: int = 256, threads: int | None = None, seed: int = 0) -> None:
        super().__init__(max_batch)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.codec = TextCodec(model_dir)

    def load_path(self, path: Path) -> None:
        self.model.load_state_dict(load_state_dict(path), strict=True)

    # ---------------------------------------------------------------- batch
    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        pad, eos = self.codec.pad_id, self.codec.eos_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        greedy = params.temperature <= 0
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=params.max_tokens, do_sample=not greedy,
            temperature=None if greedy else params.temperature, top_k=0, top_p=1.0,
            eos_token_id=eos, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # (batch, steps, vocab)
        scale = 1.0 if greedy else params.temperature
        lp = torch.log_softmax(logits / scale, dim=-1).gather(-1, new[:, : logits.shape[1], None]).squeeze(-1)
        results = []
        for i in range(len(prompts)):
            row = new[i].numpy()
            ends = np.flatnonzero(row == eos)
            n = int(ends[0]) + 1 if len(ends) else len(row)
            results.append(Completion(row[:n].astype(np.int32), lp[i, :n].numpy().astype(np.float32),
                                      self.version, bool(len(ends))))
        return results
