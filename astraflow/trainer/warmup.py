"""Supervised warm-up on the task format (the warm-up split only), so that RL starts from a
weak but non-zero policy, as it does from a base model in practice. Trains on the answer
tokens (answer + EOS) of `warmup.steps` random batches and saves the model in place."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from astraflow.config.schema import Config
from astraflow.models.tokenizer import TextCodec
from astraflow.tasks.sources import TaskSource

log = logging.getLogger(__name__)


def warm_up(model_dir: Path, cfg: Config) -> float:
    """Returns the last batch's loss."""
    w = cfg.warmup
    items = TaskSource(cfg.tasks).warmup
    if w.steps <= 0 or not items:
        return float("nan")
    torch.manual_seed(cfg.run.seed)
    codec = TextCodec(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=w.lr)
    rng = np.random.default_rng(cfg.run.seed)
    loss = torch.tensor(float("nan"))
    for step in range(w.steps):
        rows = [items[i] for i in rng.integers(len(items), size=w.batch_size)]
        seqs = [(codec.encode_prompt(r.prompt), codec.encode_completion(r.answer)) for r in rows]
        width = max(len(p) + len(a) for p, a in seqs)
        ids = torch.full((len(seqs), width), codec.pad_id)
        labels = torch.full((len(seqs), width), -100)
        for i, (p, a) in enumerate(seqs):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, attention_mask=(ids != codec.pad_id).long(), labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.save_pretrained(model_dir, safe_serialization=True)
    log.info("warm-up: %d steps on %d prompts, final loss %.3f", w.steps, len(items), float(loss.detach()))
    return float(loss.detach())
