"""The `torch` trainer backend: a Hugging Face model, AdamW, DDP across the group's ranks.

Precision: the weights and the optimizer state are fp32 (the master copy); the forward and
backward passes run under autocast in the compute dtype (`model.dtype`; auto: bf16 on a GPU,
fp32 on a CPU), and the published weights are in that dtype. The device is the one the
launcher assigns (`astraflow.hardware`); collectives go over NCCL on GPUs, gloo on CPUs.

A step: the rank's share of the batch is cut into `minibatches`, each one optimizer step;
each minibatch into micro-batches of at most `max_tokens_per_microbatch` tokens whose
gradients accumulate (DDP synchronises on the last one only). The proximal policy is the
weights before the step's first update: for the first minibatch its own forward pass,
detached; for the others, scored up front without gradient. Logprobs come from
`trainer/scoring.py` (trained tokens only, logits in checkpointed chunks), the loss from
`trainer/loss.py`; the loss is a token-mean over each minibatch's trained tokens on all
ranks, so the gradient does not depend on how rows were cut into micro-batches or dealt to
ranks. `trainer.activation_checkpointing` recomputes the decoder layers' activations in the
backward pass (transformers' gradient checkpointing).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from astraflow import hardware
from astraflow.config.schema import Config
from astraflow.protocol.messages import BatchReply
from astraflow.trainer.batch import TokenBatch, micro_batches
from astraflow.trainer.checkpoint import commit_file
from astraflow.trainer.loss import LossSums, decoupled_ppo_loss
from astraflow.trainer.scoring import PolicyScorer


class TorchBackend:
    def __init__(self, model_dir: Path, cfg: Config, policy: str, rank: int, world: int) -> None:
        self.tcfg = cfg.trainer_for(policy)
        self.world = world
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

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _global(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def train_step(self, reply: BatchReply, step: int, lr: float) -> dict[str, float]:
        self.model.train()
        n = len(reply.sample_ids)
        per = max(1, n // self.tcfg.minibatches)
        parts = [[mb.to(self.device) for mb in micro_batches(reply, np.arange(lo, min(lo + per, n)),
                                                               self.tcfg.max_tokens_per_microbatch, self.pad_id)]
                 for lo in range(0, n, per)]
        with torch.no_grad(), self._autocast():  # the proximal policy of the later minibatches
            prox = [[None] * len(part) if k == 0 else [self.scorer(mb).logp.float() for mb in part]
                    for k, part in enumerate(parts)]
        for group in self.optim.param_groups:
            group["lr"] = lr
        sums, grad_norm, lag, trained = LossSums(), 0.0, 0.0, 0
        for k, part in enumerate(parts):
            # the token-mean over the minibatch on all ranks; DDP then averages over ranks
            normalizer = self._global(sum(mb.tokens for mb in part)) / self.world
            self.optim.zero_grad(set_to_none=True)
            for j, mb in enumerate(part):
                sync = self.world == 1 or j == len(part) - 1
                with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self._autocast():
                    scores = self.ddp(mb)
                    p = scores.logp.detach() if k == 0 else prox[k][j]
                    loss, mb_sums = decoupled_ppo_loss(scores.logp, p, mb.behaviour_logp, mb.advantages,
                                                       self.tcfg.clip_eps, self.tcfg.is_cap, normalizer, scores.entropy)
                    if scores.kl_ref is not None:
                        kl = scores.kl_ref.sum()
                        loss = loss + self.tcfg.ref_kl * kl / max(normalizer, 1.0)
                        mb_sums.kl_ref = float(kl)
                loss.backward()
                sums.add(mb_sums)
                lag += float((step - 1 - mb.versions).float().sum())
                trained += mb.tokens
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip))
            self.optim.step()
        stats = {"loss": sums.loss / max(trained, 1), "clip_frac": sums.mean("clipped"),
                 "is_weight": sums.mean("is_weight"), "behaviour_kl": sums.mean("behaviour_kl"),
                 "entropy": sums.mean("entropy"), "grad_norm": grad_norm,
                 "completion_len": trained / max(1, n), "version_lag": lag / trained if trained else 0.0}
        if self.tcfg.ref_kl:
            stats["kl_ref"] = sums.mean("kl_ref")
        return stats

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def save(self, ckpt_dir: Path, step: int) -> Path:
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
        with torch.no_grad(), self._autocast():
            return self.scorer(batch.to(self.device)).logp.float().cpu()
