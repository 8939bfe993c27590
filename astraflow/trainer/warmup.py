"""Supervised warm-up on a role's format (the warm-up split only), so that RL starts from a
weak but non-zero policy, as it does from a base model in practice. Trains on the target
tokens of `warmup.steps` random batches of the workflow's examples for that role (the
solver's answer, the verifier's verdict on a right or a wrong answer, the agent's tool call)
and saves the model in place."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from astraflow import hardware
from astraflow.config.schema import Config
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.tasks.sources import TaskSource
from astraflow.workflows import WORKFLOWS

log = logging.getLogger(__name__)


def warm_up(model_dir: Path, cfg: Config, role: str) -> float:
    """Returns the last batch's loss."""
    w = cfg.warmup
    items = TaskSource(cfg.tasks).warmup
    if w.steps <= 0 or not items:
        return float("nan")
    torch.manual_seed(cfg.run.seed)
    tokenizer = ModelTokenizer(model_dir, chat=cfg.tasks.chat_template, system_prompt=cfg.tasks.system_prompt)
    rng = np.random.default_rng(cfg.run.seed)
    examples = WORKFLOWS[cfg.tasks.workflow].warmup(role, items, tokenizer, rng)
    device = hardware.device()
    dtype = hardware.compute_dtype(cfg.model.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=w.lr)
    loss = torch.tensor(float("nan"))
    for step in range(w.steps):
        rows = [examples[i] for i in rng.integers(len(examples), size=w.batch_size)]
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_id)
        labels = torch.full((len(rows), width), -100)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
            attention[i, : len(p) + len(a)] = 1
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.save_pretrained(model_dir, safe_serialization=True)
    log.info("warm-up (%s): %d steps on %d examples, final loss %.3f", role, w.steps, len(examples),
             float(loss.detach()))
    return float(loss.detach())
