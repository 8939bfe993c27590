"""The `hf` engine: transformers `generate`, batched across concurrent episodes.

Requests that arrive while a batch runs are collected and run together next (continuous
batching at request granularity). Generation runs in a worker thread so the event loop
keeps serving episodes (tool calls, commits) meanwhile. Logprobs come from the raw logits
of the sampled step (`output_logits`), scaled by the temperature exactly as sampling did.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from astraflow.models.tokenizer import TextCodec
from astraflow.rollout.engines.base import Completion, SamplingParams
from astraflow.weights.fs import load_state_dict


class HFEngine:
    def __init__(self, model_dir: str | Path, max_batch: int = 256, threads: int | None = None, seed: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.codec = TextCodec(model_dir)
        self.max_batch = max_batch
        self.version = 0
        self._queue: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._runner: asyncio.Task | None = None

    # ---------------------------------------------------------------- async API
    async def generate(self, prompt: list[int], params: SamplingParams) -> Completion:
        self._ensure_runner()
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((prompt, params, fut))
        self._wake.set()
        return await fut

    async def load_weights(self, path: Path, version: int) -> None:
        self._ensure_runner()
        async with self._lock:  # between batches
            state = await asyncio.to_thread(load_state_dict, path)
            self.model.load_state_dict(state, strict=True)
            self.version = version

    def close(self) -> None:
        if self._runner:
            self._runner.cancel()

    def _ensure_runner(self) -> None:
        if self._runner is None:
            self._wake, self._lock = asyncio.Event(), asyncio.Lock()
            self._runner = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                params = self._queue[0][1]
                batch = [r for r in self._queue if r[1] == params][: self.max_batch]
                self._queue = [r for r in self._queue if not any(r is b for b in batch)]
                async with self._lock:
                    try:
                        outs = await asyncio.to_thread(self.generate_batch, [b[0] for b in batch], params)
                    except Exception as e:  # noqa: BLE001 - fail the callers, keep the engine
                        for *_, fut in batch:
                            if not fut.done():
                                fut.set_exception(e)
                        continue
                for (*_, fut), out in zip(batch, outs):
                    if not fut.done():
                        fut.set_result(out)

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
