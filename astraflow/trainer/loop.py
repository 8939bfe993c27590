"""`astraflow train --policy P`: one policy's trainer — the part every backend shares.

Per step: pull the step's batch from the dataflow rank (blocking; a replayed step after a
restart gets the same samples; each rank asks for its model replica's share, `Batch(rank =
data-parallel rank, world = replicas, member)`, so the tp x pp ranks of one replica train on
the same rows), let the backend train on it (`Backend.train_step`), publish
weights version = step (rank 0, filesystem channel, in the training dtype: a full version or
a sparse delta against the previous one, `weights/publisher.py`; in a local run also
broadcast to the policy's workers, `weights/collective.py`), announce it, then
acknowledge the step's samples (`Consumed`). Metrics go to `metrics/<policy>.csv` (a row
per trained step, appended; a replayed step gets a row again and readers merge a step's rows:
`analysis/metrics.py`) and to TensorBoard event files in `metrics/tensorboard/<policy>/`
(`analysis/sinks.py`, with a sample completion every `checkpoint_every` steps); the
sample ids of every
acknowledged step go to `metrics/<policy>.consumed.jsonl` (the trainer's own ledger, which
audits compare with the rank's journal). Every `checkpoint_every` steps the backend saves
its state; a restarted trainer resumes from the newest checkpoint and tells the dataflow
rank (`Ready(resume_step)`), which re-serves exactly the steps after it. Version v of the
weights is the model after step v (v0 = the base model).

In a group of several ranks, the backend's `hf_state_dict` and `save` are called on every
rank in the same order (collectives where the model is sharded: the megatron backend with
tp > 1); only rank 0 writes weights, talks to the dataflow rank about `Ready`, `Published`
and `Consumed`, and records metrics. Before training a step the ranks agree that all of
them have its batch: one stopped by a signal (or told the samples are exhausted) while the
others hold theirs stops them all at the same step, so that the stop checkpoint, itself a
collective, is taken by every rank.

Backends (`BACKENDS`, an explicit table; `trainer.backend`) own the model: loading, the
optimizer step on a batch, their checkpoint state, and the Hugging Face view published to
the engines. Leasing, `Ready`/`Consumed`, checkpoint bookkeeping, publishing and metrics
live here, once.

Invariant: a step is checkpointed only after the rank has acknowledged its samples. The
other way round, a trainer killed between the two resumed past a step the rank had never
seen consumed: the step was missing from the journal's lineage and its samples went back to
the buffer, to be trained again (the kill chaos test caught it: 49 of 50 steps in the lineage).
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from astraflow import hardware
from astraflow.analysis.ledgers import LEDGER_SUFFIX
from astraflow.analysis.sinks import Sinks, best_completion, open_sinks
from astraflow.config.rundir import RunDir
from astraflow.models import wait_for_model
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, moved_to, read_rendezvous, wait_rendezvous
from astraflow.protocol.codec import RemoteError
from astraflow.slurm.endpoint import MASTER_ENV
from astraflow.slurm.env import partition
from astraflow.store.appendonly import append_json_line
from astraflow.trainer.backend import Backend
from astraflow.trainer.checkpoint import checkpoint_steps, latest_checkpoint, prune_checkpoints
from astraflow.trainer.lr import lr_at
from astraflow.trainer.torch_backend import TorchBackend
from astraflow.weights.collective import TrainerChannel
from astraflow.weights.manifest import WeightsError, newest_dir
from astraflow.weights.publisher import Publisher
from astraflow.weights.reader import load_version

log = logging.getLogger(__name__)

BATCH_TIMEOUT_S = 30.0
STOPPED_TIMEOUT_S = 5.0  # how long a stopping trainer tries to tell the rank
STOP_POLL_S = 0.5  # how often a trainer waiting for a batch looks at its stop flag


def _megatron(*args) -> Backend:
    """Imported when used: megatron-core is heavy, and redirects its CUDA calls on a CPU."""
    from astraflow.trainer.megatron.backend import MegatronBackend

    return MegatronBackend(*args)


BACKENDS: dict[str, Callable[..., Backend]] = {"torch": TorchBackend, "megatron": _megatron}

METRIC_FIELDS = ("step", "time", "reward_mean", "reward_trained", "generated", "loss", "clip_frac", "is_weight",
                 "behaviour_kl", "entropy", "grad_norm", "samples", "tokens", "completion_len", "version_lag",
                 "wait_s", "train_s", "lr")


class TrainerStopped(Exception):
    """A stop signal arrived while waiting for a batch."""


# what a rank has after asking for a step's batch; the group takes the largest (`_agree`)
HAS_BATCH, EXHAUSTED, STOPPED = 0, 1, 2


class Trainer:
    def __init__(self, run: RunDir, policy: str, rank: int = 0, world: int = 1) -> None:
        self.run, self.cfg, self.policy = run, run.config, policy
        self.tcfg = run.config.trainer_for(policy)
        self.rank, self.world = rank, world
        torch.manual_seed(run.config.run.seed + rank)
        self.base_dir = wait_for_model(run.path, run.config, policy)  # it may still be being prepared
        self.backend: Backend = BACKENDS[self.tcfg.backend](self.base_dir, run.config, policy, rank, world)
        self.metric_fields = METRIC_FIELDS + (("kl_ref",) if self.tcfg.ref_kl else ())
        self.ckpt_dir = run.path / "checkpoints" / policy
        self.step = 0
        ckpt = latest_checkpoint(self.ckpt_dir)
        if ckpt is not None:
            self.step = self.backend.load(ckpt)
            log.info("resumed from %s (step %d)", ckpt.name, self.step)
        self.publisher = Publisher(run.path / "weights", policy, self.base_dir, self.backend.publish_dtype,
                                   run.config.weights.full_every)
        # rank 0, in a local run: each version is also broadcast to the policy's workers
        self.channel = TrainerChannel(run.path, policy, run.config.weights) if rank == 0 else None
        self.client = Client(wait_rendezvous(run.path)["address"], run.read_secret(), timeout_s=BATCH_TIMEOUT_S)
        self.stop = False
        # rank 0's (analysis/sinks.py), opened now: a backend that cannot open (W&B without
        # credentials, an MLflow server down) stops the trainer at its start, not at a step
        self.sinks: Sinks | None = (open_sinks(run.path, policy, self.metric_fields, run.config)
                                    if rank == 0 else None)
        self._decode: Callable[[list[int]], str] | None = None
        signal.signal(signal.SIGUSR1, self._checkpoint_and_stop)  # Slurm's warning before preemption
        signal.signal(signal.SIGTERM, self._checkpoint_and_stop)

    def _checkpoint_and_stop(self, signum, frame) -> None:
        self.stop = True

    def call(self, request, interruptible: bool = False):
        """Retry through dataflow restarts; every request the trainer makes is idempotent.

        An `interruptible` request (waiting for a batch) gives up when a stop signal arrives,
        so that the trainer checkpoints at once instead of waiting for data that may never
        come (the dataflow rank is being stopped too)."""
        while True:
            seq = self.client.send(request)
            deadline = time.monotonic() + BATCH_TIMEOUT_S
            while time.monotonic() < deadline:
                reply = self.client.poll(seq, STOP_POLL_S)
                if reply is not None:
                    return reply
                if interruptible and self.stop:
                    self.client.abandon(seq)
                    raise TrainerStopped
                if moved_to(self.run.path, self.client.address):
                    break  # the rank restarted elsewhere: resend there now, not after the timeout
            self.client.abandon(seq)
            self.client.reconnect(read_rendezvous(self.run.path)["address"])

    def publish(self, step: int) -> m.Published | None:
        """Every rank gives its part of the weights (a collective where they are sharded);
        rank 0 writes and broadcasts them and returns the announcement, the others None."""
        weights = self.backend.hf_state_dict()
        if self.rank != 0:
            return None
        pub = self.publisher.publish(weights, step)
        log.info("published v%d (%s, %d bytes, %d of %d elements changed) in %.0f ms", step, pub.manifest.kind,
                 pub.bytes_written, pub.manifest.changed, pub.manifest.elements, pub.seconds * 1e3)
        sent = self.channel.send(self.publisher.last, pub.manifest) if self.channel is not None else None
        if sent is not None:  # before `Published`: the workers then learn of it with the weights in hand
            log.info("broadcast v%d in %.0f ms", step, sent * 1e3)
        return m.Published(self.policy, step, pub.uri, checkpoint_steps(self.ckpt_dir), pub.full, pub.base_uri)

    def republish_if_damaged(self) -> None:
        """The resumed step's published weights are what workers load first: if they are
        missing or damaged, publish them again from the checkpoint (the same model) as a full
        version; if they are intact, the next version is a delta against them."""
        if self.step == 0:
            return
        damaged: list[str | None] = [None]  # rank 0 reads the version; the group learns what it found
        if self.rank == 0:
            try:
                weights, manifest = load_version(self.run.path / "weights", self.policy, self.step)
                self.publisher.adopt(weights, newest_dir(self.run.path / "weights" / self.policy, self.step))
            except WeightsError as e:
                damaged = [str(e)]
        if self.world > 1:
            dist.broadcast_object_list(damaged, src=0)
        if damaged[0] is not None:
            log.error("republishing v%d from the checkpoint: %s", self.step, damaged[0])
            published = self.publish(self.step)
            if published is not None:
                self.call(published)

    def run_loop(self) -> None:
        self.republish_if_damaged()
        if self.rank == 0:  # one Ready per group: a second one would hand back what rank 0 was served
            ready = self.call(m.Ready(m.PROTOCOL_VERSION, self.policy, self.step, hardware=hardware.describe(),
                                      partition=partition(), world=self.world))
            if ready.replay_steps:
                log.info("dataflow rank will replay steps %s", ready.replay_steps)
        if self.world > 1:
            dist.barrier()
        while self.step < self.tcfg.steps:
            try:
                row = self.train_step(self.step + 1)
            except TrainerStopped:
                break
            if row is None:
                break
        # a signal that reached some ranks after their last step: all of them checkpoint, or none
        self.stop = self._agree(STOPPED if self.stop else HAS_BATCH) == STOPPED
        if self.sinks is not None:
            self.sinks.close()
        if self.stop:
            self.checkpoint(self.step)
            if self.rank == 0:
                log.info("stopped by a signal: checkpointed step %d", self.step)
                self.say_stopped()
        self.client.close()

    def say_stopped(self) -> None:
        """Tell the rank (once, briefly: it may be gone already) that this group has stopped;
        on Slurm's warning its supervisor waits for that before it stops the rank."""
        try:
            self.client.call(m.Stopped(self.policy, self.step), timeout_s=STOPPED_TIMEOUT_S)
        except (TimeoutError, RemoteError) as e:
            log.warning("could not tell the dataflow rank that this trainer stopped: %s", e)

    def record(self, row: dict, batch: m.TrajectoryBatch) -> None:
        """The step's row to every sink (rank 0 only); every `checkpoint_every` steps its best
        completion as text too."""
        self.sinks.scalars(row, row["step"], row["time"])
        if row["step"] % self.tcfg.checkpoint_every == 0 and len(batch.reward):
            if self._decode is None:
                from astraflow.models.tokenizer import load_hf_tokenizer

                tokenizer = load_hf_tokenizer(self.base_dir)
                self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
            self.sinks.text("best_completion", best_completion(batch, self._decode), row["step"])

    def fetch(self, step: int) -> tuple[int, m.BatchReply | None]:
        """This rank's share of the step's batch: (HAS_BATCH, reply), or (EXHAUSTED | STOPPED, None)."""
        b = self.backend
        if self.stop:
            return STOPPED, None
        try:
            return HAS_BATCH, self.call(m.Batch(self.policy, step, self.tcfg.batch_size, b.data_rank, b.data_world,
                                                self.step, b.member), interruptible=True)
        except TrainerStopped:
            return STOPPED, None
        except RemoteError as e:
            if e.code == "exhausted":
                return EXHAUSTED, None
            raise

    def _agree(self, outcome: int) -> int:
        """The group's outcome: the largest of its ranks' (a stop or exhaustion stops all)."""
        if self.world == 1:
            return outcome
        flag = torch.tensor([outcome], dtype=torch.int64, device=hardware.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def train_step(self, step: int) -> dict | None:
        t0 = time.perf_counter()
        outcome, reply = self.fetch(step)
        outcome = self._agree(outcome)
        if outcome == STOPPED:
            self.stop = True
            raise TrainerStopped
        if outcome == EXHAUSTED:
            log.info("no samples left: stopping at step %d", self.step)
            return None
        wait = time.perf_counter() - t0
        lr = lr_at(self.tcfg, step)
        stats = self.backend.train_step(reply, step, lr)
        self.step = step
        # every rank says what it trained on: the ranks of one model replica name the same rows
        digest = hashlib.sha256(reply.sample_ids.astype(np.int64).tobytes()).hexdigest()[:16]
        log.info("rank %d trained step %d on %d samples (ids %s): loss %.9g", self.rank, step,
                 len(reply.sample_ids), digest, stats["loss"])
        ids = self._all_sample_ids(reply)
        n, replicas = len(reply.sample_ids), self.backend.data_world
        row = {"step": step, "time": time.time(), "reward_mean": reply.generated_reward_mean,
               "reward_trained": float(reply.trajectories.reward.mean()), "generated": reply.generated_count,
               "samples": n * replicas, "tokens": int(reply.trajectories.lengths.sum()) * replicas,
               "wait_s": wait, "train_s": time.perf_counter() - t0 - wait, "lr": lr, **stats}
        if self.rank == 0:
            # the metrics row before `Consumed`: killed in between, the step is replayed and its
            # rows merged; killed after `Consumed` with the row unwritten, the step was lost to them
            self.record(row, reply.trajectories)
        published = self.publish(step)  # every rank: a collective where the model is sharded
        if published is not None:
            self.call(published)
            self.call(m.Consumed(self.policy, step, ids))
            # the trainer's own ledger; a line the disk has no room for stops the trainer, which
            # then replays the step from its checkpoint (written below, after this line)
            append_json_line(self.run.path / "metrics" / f"{self.policy}{LEDGER_SUFFIX}", {"step": step, "ids": ids})
        if step % self.tcfg.checkpoint_every == 0 or step == self.tcfg.steps:
            # after the acknowledgement (see the invariant above): a sharded checkpoint is
            # committed by rank 0, after its `Consumed`
            self.checkpoint(step)
        return row

    def checkpoint(self, step: int) -> None:
        """Every rank: the backend writes what it must (rank 0 alone, or each shard)."""
        self.backend.save(self.ckpt_dir, step)
        if self.rank == 0:
            prune_checkpoints(self.ckpt_dir)

    def _all_sample_ids(self, reply: m.BatchReply) -> list[int]:
        """The step's ids, from every model replica (the members of one hold the same)."""
        ids = reply.sample_ids.tolist()
        replicas = self.backend.data_world
        if replicas == 1:
            return ids
        gathered: list[list[int]] = [None] * replicas  # type: ignore[list-item]
        dist.all_gather_object(gathered, ids, group=self.backend.data_group)
        # the dataflow rank dealt ids[rank::world] by data-parallel rank; interleave them back
        out = [None] * sum(len(g) for g in gathered)
        for r, g in enumerate(gathered):
            out[r::replicas] = g
        return out


def run_trainer(run_dir: str, policy: str) -> bool:
    """Train this rank; True when the run's steps are done, False when stopped by a signal."""
    run = RunDir.open(run_dir)
    rank = int(os.environ.get("ASTRAFLOW_RANK", "0"))
    world = int(os.environ.get("ASTRAFLOW_WORLD", str(run.config.trainer.world)))
    torch.set_num_threads(run.config.trainer_for(policy).threads)
    if world > 1:
        # On Slurm a TCP store at rank 0 (slurm/endpoint.py), its keys under the group's start
        # (a rank of a restarted group that reaches the last start's store while it shuts down
        # finds none of that start's keys); locally a fresh file per launch (session) and group
        # start: a FileStore left by a crashed group or an earlier launch cannot be reused.
        # NCCL between GPUs, gloo on CPUs.
        start, timeout = os.environ.get("ASTRAFLOW_START", "0"), datetime.timedelta(seconds=120)
        if os.environ.get(MASTER_ENV):
            where = f"tcp://{os.environ[MASTER_ENV]}"
            host, port = os.environ[MASTER_ENV].rsplit(":", 1)
            store = dist.PrefixStore(f"start-{start}/", dist.TCPStore(
                host, int(port), world, is_master=rank == 0, timeout=timeout, wait_for_workers=False))
        else:
            session = os.environ.get("ASTRAFLOW_SESSION", "manual")
            path = Path(run.path) / "rendezvous" / f"torch-{policy}-{session}-{start}"
            where, store = f"file://{path}", dist.FileStore(str(path), world)
        device = hardware.device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        log.info("trainer group of %d: rank %d, %s, rendezvous at %s", world, rank, backend, where)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    trainer = Trainer(run, policy, rank, world)
    trainer.run_loop()
    if world > 1:
        dist.destroy_process_group()
    return trainer.step >= trainer.tcfg.steps or not trainer.stop
