"""The `megatron` trainer backend: a megatron-core GPTModel, tensor-, pipeline- and data-parallel.

Built for one rank of a trainer group whose torch.distributed world is already initialised
when `world > 1` (`trainer/loop.py`): megatron's groups are formed over it with
`trainer.tp` and `trainer.pp`; the rest of the world is data parallel. The model (this
rank's pipeline stage of it) is built from the policy's HF directory and loaded through
`mapping.py`; its logprobs are computed vocabulary-parallel (`scoring.py`); the step is the
shared one (`trainer/step.py`: the torch backend's loss, KL term and statistics), its
micro-batches run one after another at pp = 1 and through megatron's pipeline schedule at
pp > 1 (`pipeline.py`), where the step's statistics are the last stage's, broadcast.

This backend's part of a step: gradients accumulate locally over micro-batches, in fp32,
then are averaged over the data-parallel group (one all-reduce per parameter, on the
minibatch's last micro-batch), the two copies of tied embeddings on the first and last
pipeline stages get the sum of their gradients (Megatron's embedding group), under sequence
parallelism the norms' gradients (each rank saw a slice of the sequence) are summed over the
tensor-parallel group, and all are clipped by their global norm (the squares of tensor-parallel shards summed over the
tensor-parallel group, replicated parameters counted once, stages summed over the pipeline
group), and `torch.optim.AdamW` steps fp32 master weights (`master.py`; Megatron's own
optimizer needs a GPU). With `trainer.distributed_optimizer` the masters and AdamW state
are sharded over the data-parallel replicas, each parameter stepped by its owner and
broadcast (ZeRO stage 1, as Megatron's distributed optimizer). The model's parameters are
in the compute dtype (bf16 on a GPU), as Megatron runs them, not fp32 under autocast:
Megatron's activation recompute (`trainer.activation_checkpointing`: full recompute)
re-runs layers outside any autocast region.

`hf_state_dict` is the model in HF layout. With tp = pp = 1 every rank holds the whole model
and converts its own; otherwise it gathers the shards of every stage and tensor-parallel
rank, a collective called on every rank of the group (`trainer/loop.py`). `save` is a
collective too: a checkpoint is a directory `step-<N>/` with one file per stage,
tensor-parallel rank and optimizer shard (`tp<t>-pp<p>-dp<d>.pt`: the fp32 masters and AdamW
state the shard owns, by parameter name, with tp and pp recorded), written under a temporary
name and renamed by rank 0 once every file is there. `load` reads every shard's file of its
stage and tensor-parallel rank, so a checkpoint loads into the same tp and pp with any number
of data-parallel replicas, sharded or not; at another tp or pp it reads them all and cuts
them again (`reshard.py`).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file

from astraflow import hardware
from astraflow.config.schema import Config
from astraflow.protocol.messages import BatchReply
from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.checkpoint import commit_file, fsync_dir
from astraflow.trainer.megatron import model as mm
from astraflow.trainer.megatron import reshard
from astraflow.trainer.megatron.mapping import EMBEDDING, OUTPUT, from_stages, stage_kinds, to_hf, to_megatron, to_stage
from astraflow.trainer.megatron.master import MasterWeights
from astraflow.trainer.megatron.pipeline import Pipeline
from astraflow.trainer.megatron.scoring import score
from astraflow.trainer.megatron.spec import ModelSpec
from astraflow.trainer.scoring import Scores
from astraflow.trainer.step import Sequential, summed, train_step


def read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """An HF directory's weights (one safetensors file or an index of shards), in fp32."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(model_dir / name)))
    return {k: v.float() for k, v in out.items()}


class MegatronBackend:
    def __init__(self, model_dir: Path, cfg: Config, policy: str, rank: int, world: int) -> None:
        self.tcfg = cfg.trainer_for(policy)
        self.rank = rank
        self.tp, self.pp = self.tcfg.tp, self.tcfg.pp
        self.device = hardware.device()
        self.dtype = hardware.compute_dtype(cfg.model.dtype, self.device)
        self.publish_dtype = self.dtype
        if not dist.is_initialized():  # a group of one: megatron's groups still need a process group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mm.init_parallel(self.tp, self.pp, cfg.run.seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.member = self.pp_rank * self.tp + self.tp_rank
        self.data_rank = parallel_state.get_data_parallel_rank()
        self.data_world = parallel_state.get_data_parallel_world_size()
        self.data_group = parallel_state.get_data_parallel_group()
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.spec = ModelSpec.of(config)
        kinds = stage_kinds(self.spec, self.pp, self.pp_rank)
        self.sharded = {name for name, kind in kinds.items() if kind != "replicated"}
        # tied embeddings across stages: the first stage's embedding and the last stage's copy
        self.tied_copy = {0: EMBEDDING, self.pp - 1: OUTPUT}.get(self.pp_rank) if self.spec.tied and self.pp > 1 \
            else None
        self.padding_idx = config.get("pad_token_id")  # as the HF model's embedding: model.hidden_states
        self.pad_id = int(self.padding_idx or 0)
        hf = read_hf_weights(model_dir)
        self.model = self._build(hf, self.tcfg.activation_checkpointing)
        self.ref = None
        if self.tcfg.ref_kl:  # the starting policy, frozen, for the KL term
            self.ref = self._build(hf, False).eval()
            self.ref.requires_grad_(False)
        self.temperature = cfg.engine.temperature
        shards = self.data_world if self.tcfg.distributed_optimizer else 1
        self.optim = MasterWeights(self.model, self.tcfg.lr, self.tcfg.weight_decay, shards, self.data_rank % shards,
                                   self.data_group if shards > 1 else None)
        self.schedule = Pipeline(self) if self.pp > 1 else Sequential(self)

    def _build(self, hf: dict[str, torch.Tensor], recompute: bool) -> torch.nn.Module:
        model = mm.build_model(self.spec, self.tp, self.pp, self.dtype, recompute, self.tcfg.sequence_parallel)
        shard = to_megatron(hf, self.spec, self.tp, self.tp_rank)
        mm.load_shard(model, to_stage(shard, self.spec, self.pp, self.pp_rank))
        return model.to(self.device)

    # ---------------------------------------------------------------- the step (trainer/step.py)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the parameters are in the compute dtype (`master.py`)

    def data_sum(self, value: float) -> float:
        return summed(value, self.data_world, self.device, parallel_state.get_data_parallel_group())

    def scores(self, batch: TokenBatch, train: bool) -> Scores:
        return score(self.model, batch, self.temperature, self.spec.vocab, self.tcfg.logprob_chunk_tokens, self.ref,
                     self.padding_idx)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # gradients are synchronised in finish_gradients

    def finish_gradients(self) -> float:
        named = self.optim.named_grads  # fp32, accumulated over the micro-batches
        grads = [g for _, g in named]
        if self.data_world > 1:
            group = parallel_state.get_data_parallel_group()
            for g in grads:
                dist.all_reduce(g, group=group)
                g.div_(self.data_world)
        if self.tied_copy is not None:  # the tied weight's gradient: both copies' uses
            dist.all_reduce(dict(named)[self.tied_copy], group=parallel_state.get_embedding_group())
        # which parameters are split across the tensor-parallel ranks: from the mapping's table
        # (Megatron marks them only when it initialises the weights, which is skipped here)
        split = [n in self.sharded for n, _ in named]
        if self.tcfg.sequence_parallel:  # the norms saw only this rank's slice of the sequence
            for g, s in zip(grads, split):
                if not s:
                    dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        counted = [not (self.tied_copy == OUTPUT and n == OUTPUT) for n, _ in named]  # the copy: once
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sharded = sum((g.double().pow(2).sum() for g, s, c in zip(grads, split, counted) if s and c), zero)
        if self.tp > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        total = sharded + sum((g.double().pow(2).sum() for g, s in zip(grads, split) if not s), zero)
        if self.pp > 1:
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        norm = float(total.sqrt())
        coef = min(1.0, self.tcfg.grad_clip / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def train_step(self, reply: BatchReply, step: int, lr: float) -> dict[str, float]:
        return self._from_last_stage(train_step(self, reply, step, lr))

    def _from_last_stage(self, value: Any) -> Any:
        """The last pipeline stage's `value`, on every stage (where the losses are computed)."""
        if self.pp == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]

    # ---------------------------------------------------------------- weights and checkpoints

    def gather_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` by this rank's parameter names (weights, or gradients), from every stage and
        tensor-parallel rank of the model, in HF layout (on the CPU): a collective."""
        own = {k: v.detach().cpu() for k, v in tensors.items()}
        if self.tp * self.pp == 1:
            return to_hf([own], self.spec)
        gathered: list[Any] = [None] * (self.tp * self.pp)
        dist.all_gather_object(gathered, (self.tp_rank, self.pp_rank, own),
                               group=parallel_state.get_model_parallel_group())
        parts = {(t, p): part for t, p, part in gathered}
        return to_hf([from_stages([parts[t, p] for p in range(self.pp)], self.spec) for t in range(self.tp)],
                     self.spec)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.gather_hf(mm.parameters(self.model))

    @property
    def shard_name(self) -> str:
        """This rank's checkpoint file: its stage, tensor-parallel rank and optimizer shard."""
        return f"tp{self.tp_rank}-pp{self.pp_rank}-dp{self.optim.shard}.pt"

    def save(self, ckpt_dir: Path, step: int) -> Path:
        """A collective: every rank calls it; the ranks of the first replica write (with the
        distributed optimizer, of every replica: each its own shard), rank 0 commits."""
        ckpt_dir = Path(ckpt_dir)
        final, tmp = ckpt_dir / f"step-{step}", ckpt_dir / f".step-{step}.tmp"
        if self.rank == 0:  # a fresh temporary directory: one left by a group killed mid-save goes
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if self.data_rank == self.optim.shard:  # the other replicas hold the same shard
            part = tmp / f".{self.shard_name}.tmp"
            torch.save({"masters": self.optim.state(), "step": step, "tp": self.tp, "pp": self.pp}, part)
            commit_file(part, tmp / self.shard_name)
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)  # this step saved before (a replayed step)
            os.replace(tmp, final)
            fsync_dir(ckpt_dir)
        dist.barrier()  # the checkpoint exists on return, on every rank
        return final

    def load(self, path: Path) -> int:
        """This rank's part of a checkpoint saved at any layout (`reshard.py`): its own files'
        at the same tp and pp (any number of data-parallel replicas, sharded or not), the
        whole checkpoint cut again at another."""
        step, parts = reshard.read(Path(path), self.tp_rank, self.pp_rank, self.tp, self.pp, self.spec)
        self.optim.load(parts)
        return step

    def score(self, batch: TokenBatch) -> torch.Tensor:
        """Log-probabilities of a batch's targets under the current weights (no gradient), on
        every rank."""
        logp = self.schedule.proximal([batch.to(self.device)])[0]
        return self._from_last_stage(logp.cpu() if logp is not None else None)
