"""Supervised warm-up on a role's format (the warm-up split only), so that RL starts from a
weak but non-zero policy, as it does from a base model in practice. Trains on the target
tokens of `warmup.steps` random batches of the workflow's examples for that role (the
solver's answer, the verifier's verdict on a right or a wrong answer, the agent's tool call)
and saves the model in place. The loss is the mean negative log-likelihood of the target
tokens, computed like the RL loss's logprobs (`trainer/scoring.py`: logits of target
positions only, in chunks), a fraction of a full-vocabulary pass over every position."""
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
from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.scoring import PolicyScorer
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
    examples = WORKFLOWS[cfg.tasks.workflow].warmup(role, items, tokenizer, rng, cfg)
    device = hardware.device()
    dtype = hardware.compute_dtype(cfg.model.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=w.lr)
    scorer = PolicyScorer(model, temperature=1.0)
    loss = torch.tensor(float("nan"))
    for step in range(w.steps):
        rows = [examples[i] for i in rng.integers(len(examples), size=w.batch_size)]
        batch = TokenBatch.of_rows([p + a for p, a in rows], tokenizer.pad_id, first=[len(p) for p, _ in rows])
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = -scorer(batch.to(device)).logp.mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.save_pretrained(model_dir, safe_serialization=True)
    log.info("warm-up (%s): %d steps on %d examples, final loss %.3f", role, w.steps, len(examples),
             float(loss.detach()))
    return float(loss.detach())
