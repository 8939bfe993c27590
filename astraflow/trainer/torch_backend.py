"""The `torch` trainer backend: a Hugging Face model, AdamW, DDP across the group's ranks.

Precision: the weights and the optimizer state are fp32 (the master copy); the forward and
backward passes run under autocast in the compute dtype (`model.dtype`; auto: bf16 on a GPU,
fp32 on a CPU), and the published weights are in that dtype. The device is the one the
launcher assigns (`astraflow.hardware`); collectives go over NCCL on GPUs, gloo on CPUs.

A step is `trainer/step.py` (minibatches, micro-batches, the proximal policy, the loss);
this backend's part: logprobs from `trainer/scoring.py` (trained tokens only, logits in
checkpointed chunks) through DDP, which synchronises gradients on a minibatch's last
micro-batch only, and `clip_grad_norm_`. `trainer.activation_checkpointing` recomputes the
decoder layers' activations in the backward pass (transformers' gradient checkpointing).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from astraflow import hardware
from astraflow.config.schema import Config
from astraflow.protocol.messages import BatchReply
from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.checkpoint import commit_file
from astraflow.trainer.scoring import PolicyScorer, Scores
from astraflow.trainer.step import Sequential, compute_autocast, summed, train_step


class TorchBackend:
    def __init__(self, model_dir: Path, cfg: Config, policy: str, rank: int, world: int) -> None:
        self.tcfg = cfg.trainer_for(policy)
        self.world = world
        # every rank a whole replica: data parallel over the world
        self.data_rank, self.data_world, self.data_group, self.member = rank, world, None, 0
        self.device = hardware.device()
        self.dtype = hardware.compute_dtype(cfg.model.dtype, self.device)
        self.publish_dtype = self.dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        if self.tcfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.pad_id = int(self.model.config.pad_token_id or 0)
        # the starting policy, frozen, for the KL term (`trainer.ref_kl`)
        ref = None
        if self.tcfg.ref_kl:
            ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
            ref.requires_grad_(False)
        self.scorer = PolicyScorer(self.model, cfg.engine.temperature, self.tcfg.logprob_chunk_tokens, ref)
        self.ddp: torch.nn.Module = self.scorer
        if world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.scorer, device_ids=ids)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=self.tcfg.lr, weight_decay=self.tcfg.weight_decay)
        self.schedule = Sequential(self)

    def autocast(self) -> contextlib.AbstractContextManager:
        return compute_autocast(self.device, self.dtype)

    def data_sum(self, value: float) -> float:
        return summed(value, self.world, self.device)

    def scores(self, batch: TokenBatch, train: bool) -> Scores:
        return self.ddp(batch) if train else self.scorer(batch)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP synchronises the gradients on a minibatch's last micro-batch only."""
        return contextlib.nullcontext() if self.world == 1 or last else self.ddp.no_sync()

    def finish_gradients(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip))

    def train_step(self, reply: BatchReply, step: int, lr: float) -> dict[str, float]:
        return train_step(self, reply, step, lr)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def save(self, ckpt_dir: Path, step: int) -> Path | None:
        """Rank 0 writes the checkpoint: every rank holds the same model and optimizer state."""
        if self.data_rank != 0:
            return None
        ckpt_dir = Path(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp = ckpt_dir / f".step-{step}.pt.tmp"
        torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict(), "step": step}, tmp)
        return commit_file(tmp, ckpt_dir / f"step-{step}.pt")

    def load(self, path: Path) -> int:
        state = torch.load(path, weights_only=True, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        return int(state["step"])

    def score(self, batch: TokenBatch) -> torch.Tensor:
        """Log-probabilities of a batch's targets under the current weights (no gradient)."""
        with torch.no_grad(), self.autocast():
            return self.scorer(batch.to(self.device)).logp.float().cpu()
