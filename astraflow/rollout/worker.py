"""`astraflow rollout`: a rollout worker process.

Registers with the dataflow rank, keeps `rollout.concurrency` episodes generating (each an
episode of the task's workflow; the engine batches their generation), commits each finished
group, keeps itself and its leases alive, and swaps in new weight versions from the
filesystem channel between engine batches: it learns of them from its lease and commit
replies (`latest`; a `Weights` poll only after `rollout.weight_poll_s` without such a reply), reads, verifies and applies them in a
thread (`weights/reader.py`: a delta when one version behind, the cheaper of the chain and
the last full version further behind), and hands the engine only the tensors that changed.
In a local run it also receives versions over the collective channel (`weights/collective.py`,
a thread per policy): a version received that way is installed without reading the files,
once the rank has announced it (the trainer broadcasts before `Published`). An episode's slot is free once it has
generated, not once its commit is acknowledged: the next lease overlaps the commit, so the
engine does not sit idle for both round trips (commits in flight are capped at as many
again). It follows a restarted dataflow rank through the rendezvous file and registers
again when the rank no longer knows it. On SIGTERM (or Slurm's warning signal, SIGUSR1) it
hands its leases back and exits.

Keep-alive traffic is only what silence needs (`keepalive.py`): a `Heartbeat` after an
interval without an answered request, a `Renew` for leases half their term old.

Every acknowledged commit is a line of `logs/acks-<worker>.jsonl` (task, status, sample ids):
the worker's own ledger, which audits compare with the shards. Every episode that failed on
its environment or a tool (`EpisodeError`: handed back, leasing paused) is a line of
`logs/episode-failures-<worker>.jsonl` (task, kind, reason, time), counted by kind in the
run's summary.

Invariant: a commit is retried until acknowledged (the dataflow rank recognises a repeat by
task id), so a trajectory is lost only if this process dies before it is acknowledged — and
then its task's lease expires and the task is handed out again — or if the task was handed
to another worker while this one was silent past its lease (`not_holder`: the other's
commit is the one that counts).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

from astraflow import hardware
from astraflow.analysis.ledgers import FAILURES_PREFIX
from astraflow.config.rundir import RunDir
from astraflow.config.schema import Config
from astraflow.environments.client import EnvironmentClient, EnvLimits
from astraflow.heap import long_lived, serving
from astraflow.models import wait_for_model
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.protocol import messages as m
from astraflow.protocol.aclient import AsyncClient, follow
from astraflow.protocol.backoff import Backoff
from astraflow.protocol.client import moved_to, read_rendezvous, wait_rendezvous
from astraflow.protocol.codec import RemoteError
from astraflow.rollout.keepalive import is_contact, keepalive_due
from astraflow.rollout.engines import ENGINES, import_library
from astraflow.rollout.engines.base import SamplingParams
from astraflow.slurm.env import partition, rollout_worker_id
from astraflow.store.appendonly import append_json_line
from astraflow.weights.fs import path_of
from astraflow.sandbox import Sandbox, hide_in_every_sandbox
from astraflow.workflows import WORKFLOWS, EpisodeContext, EpisodeError
from astraflow.workflows.rewards import Scorer

log = logging.getLogger(__name__)

# Lease refusals whose end nobody can predict (the trainer is behind, every task is out): asked
# again with a growing wait. A sync round's refusals end with a trainer step and keep the hint.
OPEN_ENDED = ("backpressure", "drained", "no_matching_policies")
MAX_PAUSE_S = 5.0  # the longest pause in leasing after environment or tool failures


class WorkerStopped(Exception):
    """Stop was requested while a call to the dataflow rank went unanswered."""


def build_engines(run: RunDir, policies: list[str]) -> dict[str, Any]:
    """One engine per hosted policy, loaded with the policy's starting weights (version 0).
    The engine's library is imported first: a worker started with its run overlaps that
    import (vLLM: 6-10 s on 2 cores) with the model's preparation."""
    cfg = run.config
    e = cfg.engine
    import_library(e)
    with long_lived():  # frozen first: the build's own `gc.collect()` calls skip the library
        return {p: ENGINES[e.kind](str(wait_for_model(run.path, cfg, p)), max_batch=e.max_batch, threads=e.threads,
                                   seed=cfg.run.seed, batch_wait_s=e.batch_wait_ms / 1e3, dtype=e.dtype,
                                   max_model_len=e.max_model_len, gpu_memory_utilization=e.gpu_memory_utilization,
                                   tensor_parallel_size=e.tensor_parallel_size, enforce_eager=e.enforce_eager,
                                   **({"partial": True} if cfg.rollout.partial else {}))
                for p in policies}


def run_tokenizer(run: RunDir) -> ModelTokenizer:
    """The tokenizer every policy of the run shares (records of several policies may share one
    sequence), with the task's prompt format."""
    cfg = run.config
    return ModelTokenizer(wait_for_model(run.path, cfg, cfg.policy_names[0]), chat=cfg.tasks.chat_template,
                          system_prompt=cfg.tasks.system_prompt)


def sampling_params(cfg: Config, tokenizer: ModelTokenizer, temperature: float | None = None) -> SamplingParams:
    e = cfg.engine
    return SamplingParams(e.max_tokens, e.temperature if temperature is None else temperature, stop=tokenizer.stop_ids)


def episode_context(cfg: Config, engines: dict[str, Any], tokenizer: ModelTokenizer, rng: np.random.Generator,
                    temperature: float | None = None, **extra: Any) -> EpisodeContext:
    """What the run's workflow gets: its engines, the tokenizer, the config's sampling, reward,
    roles and workflow settings (`extra`: what only a worker has, its environment and tools)."""
    return EpisodeContext(engines=engines, tokenizer=tokenizer, params=sampling_params(cfg, tokenizer, temperature),
                          reward=Scorer(cfg.tasks.reward, cfg.tasks.reward_timeout_s),
                          policy_index={p: i for i, p in enumerate(cfg.policy_names)}, rng=rng, roles=cfg.roles,
                          workflow=cfg.workflow, tasks=cfg.tasks, **extra)


class RolloutWorker:
    """One worker's membership of one run. It uses engines it is given (a standby worker keeps
    its engines from run to run) or builds its own, which it closes when it leaves."""

    def __init__(self, run: RunDir, policies: list[str], base_id: str, engines: dict[str, Any] | None = None) -> None:
        self.rundir, self.cfg = run, run.config
        self.policies = policies
        self.base_id = base_id
        self.engines = engines
        self.own_engines = engines is None
        self.worker_id = ""
        self.inflight: dict[int, asyncio.Task] = {}  # leased tasks until committed or handed back
        self.leased_at: dict[int, float] = {}  # task -> when its lease was granted or last renewed (monotonic)
        self.last_contact = time.monotonic()  # the last answered request that named this worker
        self.last_latest = 0.0  # the last reply that named the published versions (monotonic)
        self.generating: set[int] = set()  # ... of which the episode still runs: these hold the slots
        self.slot_freed = asyncio.Event()
        self.stopping = False
        self.committed = 0
        self.episode_failures: Counter[str] = Counter()  # by EpisodeError.kind
        self.refused: dict[str, int] = {}  # policy -> the damaged weight version last refused
        self.followers: dict[str, Any] = {}  # policy -> its `weights.follower.Follower`, once torch may load
        self.arrived: dict[str, tuple] = {}  # policy -> the newest version received over the collective channel
        self.failing = 0  # episode failures in a row
        self.pause_until = 0.0  # no leases before this (monotonic), after episode failures
        self.lease_backoff = Backoff()  # between refused leases
        self.engine_load_s = 0.0
        self.newer_weights = asyncio.Event()  # a reply said a newer version is out: load it now
        self.hardware = ""  # described once the engines are built: torch must load after OMP_NUM_THREADS is set
        self.registering = asyncio.Lock()  # one registration at a time (see rpc)

    # ------------------------------------------------------------- plumbing
    async def rpc(self, make: Callable[[], Any]) -> Any:
        """Call until answered: follow a restarted rank, register again when forgotten — once,
        however many calls in flight learn of it: each registration ends the incarnation
        before it (and hands back its leases), so one per call made them end each other in a
        cascade (36 incarnations for 8 calls)."""
        while True:
            request = None
            try:
                async with self.registering:
                    if not self.worker_id:
                        await self.register()
                request = make()
                reply = await self.client.call(request)
                if is_contact(request):
                    self.last_contact = time.monotonic()
                self.notice(getattr(reply, "latest", {}))
                return reply
            except TimeoutError:
                if self.stopping:  # the rank is gone (the run ended) or unreachable: leave
                    raise WorkerStopped from None
                self.client.reconnect(read_rendezvous(self.rundir.path)["address"])
            except RemoteError as e:
                if e.code != "unknown_worker":
                    raise
                if getattr(request, "worker_id", None) == self.worker_id:
                    self.worker_id = ""  # this incarnation is forgotten, not an older one
            await asyncio.sleep(0.1)

    async def register(self) -> None:
        reply = await self.client.call(m.Register(
            m.PROTOCOL_VERSION, self.base_id, self.policies, capacity=self.cfg.rollout.concurrency,
            hardware=self.hardware,
            partition=partition(), host=socket.gethostname(), pid=os.getpid(), engine_load_s=self.engine_load_s))
        self.worker_id = reply.worker_id
        self.heartbeat_s, self.lease_s = reply.heartbeat_s, reply.lease_s  # the rank's, which may differ from ours
        log.info("registered as %s", self.worker_id)

    async def environment(self) -> EnvironmentClient | None:
        """The workflow's environment server: the built-in one (a child process), or a URL."""
        w = self.cfg.workflow
        if self.cfg.tasks.workflow != "multi_turn_tool" and not w.env_check:
            return None
        if w.environment == "builtin":
            return await EnvironmentClient.builtin(w, seed=self.cfg.run.seed + os.getpid())
        return EnvironmentClient(w.environment, os.environ.get("ASTRAFLOW_ENV_TOKEN", ""), limits=EnvLimits.of(w))

    def notice(self, latest: dict[str, int]) -> None:
        """Wake the weights loop when a lease or commit reply names a version not loaded yet
        (and not refused as damaged: that one waits for the poll)."""
        if latest:
            self.last_latest = time.monotonic()
        for policy, engine in self.engines.items():
            if latest.get(policy, -1) > engine.version and latest[policy] != self.refused.get(policy):
                self.newer_weights.set()

    async def weights_changed(self, held: dict[str, int], timeout_s: float) -> None:
        """Wait until the engines run other weights than `held`, for at most timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.versions() == held and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def versions(self) -> dict[str, int]:
        return {p: e.version for p, e in self.engines.items()}

    # ------------------------------------------------------------- loops
    async def heartbeat_loop(self) -> None:
        while True:
            every = min(self.heartbeat_s, self.lease_s / 3)  # as of the last registration
            await asyncio.sleep(every)
            now = time.monotonic()
            heartbeat, due = keepalive_due(now, self.last_contact, self.leased_at, every, self.lease_s / 2)
            if heartbeat:
                await self.rpc(lambda: m.Heartbeat(self.worker_id, self.versions()))
            if due:
                reply = await self.rpc(lambda: m.Renew(self.worker_id, due))
                self.leased_at.update(dict.fromkeys(reply.renewed, now))
                for task_id in reply.lost:  # handed to someone else: nothing left to renew
                    self.leased_at.pop(task_id, None)

    async def follow_loop(self) -> None:
        """Reconnect as soon as a restarted rank publishes its new address (`aclient.follow`:
        the rendezvous file is read only while the connection is down): calls in flight fail
        at once and are retried, instead of each waiting out its timeout."""
        await follow(self.client, lambda: moved_to(self.rundir.path, self.client.address))

    def receive(self, policy: str, tensors: dict, manifest, received: int) -> None:
        """Called in the collective channel's thread: keep the newest, wake the weights loop."""
        def arrive() -> None:
            self.arrived[policy] = (tensors, manifest, received)
            self.newer_weights.set()
        self.loop.call_soon_threadsafe(arrive)

    async def weights_loop(self) -> None:
        while True:
            for policy, engine in self.engines.items():
                reply = await self.rpc(lambda: m.Weights(policy))
                arrived = self.arrived.get(policy)
                # a version received before the rank announced it waits: the rank refuses
                # commits of versions it has not seen published
                if arrived is not None and arrived[1].version <= reply.version:
                    del self.arrived[policy]
                    await self.take(policy, engine, *arrived)
                if reply.version > engine.version:
                    await self.load(policy, engine, reply)
            await self.until_weights_worth_asking()
            self.newer_weights.clear()

    async def until_weights_worth_asking(self) -> None:
        """Until a reply names a newer version, or for `weight_poll_s` without any reply that
        names versions (a worker that leases and commits hears of each version anyway), or a
        damaged version waits to be asked for again."""
        poll_s = self.cfg.rollout.weight_poll_s
        while True:
            try:
                await asyncio.wait_for(self.newer_weights.wait(), poll_s)
                return
            except TimeoutError:
                if self.refused or time.monotonic() - self.last_latest >= poll_s:
                    return

    async def load(self, policy: str, engine, reply: m.WeightsReply) -> None:
        """Bring the engine to a new version (`weights/follower.py`: in a thread, a delta, a
        chain or a full version). A damaged version is skipped for the newest full version
        that loads; short of the announced version, it is refused (logged once) until a newer
        one is announced — a trainer resuming from a damaged version republishes it."""
        try:
            update = await self.followers[policy].bring(engine, path_of(reply.uri))
        except Exception as e:  # noqa: BLE001 - a bad version must not kill the worker
            self._refuse(policy, reply.version, engine, repr(e))
            return
        if update.how != "held":
            log.info("%s: loaded weights v%d (%s, %d bytes read, %s tensors changed) in %.0f ms", policy,
                     update.version, update.how, update.bytes_read,
                     "all" if update.changed is None else len(update.changed), update.seconds * 1e3)
        if update.version < reply.version:
            self._refuse(policy, reply.version, engine, f"reached only {update.name}")

    async def take(self, policy: str, engine, tensors: dict, manifest, received: int) -> None:
        t0 = time.perf_counter()
        try:
            changed = await self.followers[policy].take(engine, tensors, manifest)
        except Exception as e:  # noqa: BLE001 - weights that do not fit must not kill the worker
            self._refuse(policy, manifest.version, engine, repr(e))
            return
        if changed != frozenset():
            log.info("%s: loaded weights v%d (collective, %d bytes received, %s tensors changed) in %.0f ms", policy,
                     manifest.version, received, "all" if changed is None else len(changed),
                     (time.perf_counter() - t0) * 1e3)

    def _refuse(self, policy: str, version: int, engine, problem: str) -> None:
        if self.refused.get(policy) != version:
            self.refused[policy] = version
            log.error("%s: weights v%d not loaded, staying at v%d: %s", policy, version, engine.version, problem)

    async def episode(self, task: m.Task) -> None:
        try:
            trajs = await self.workflow(task, self.ctx)
        except EpisodeError as e:
            # the environment or a tool failed, not this worker: the task goes back to the
            # queue, and no new task is leased for a while (doubling while failures go on)
            self.episode_failures[e.kind] += 1
            self.failing += 1
            self.pause_until = time.monotonic() + min(MAX_PAUSE_S, 0.25 * 2 ** min(self.failing, 8))
            log.warning("task %d: %s; handing it back", task.task_id, e)
            self.record(self.failures, {"task": task.task_id, "kind": e.kind, "reason": str(e), "time": time.time()})
            await self.rpc(lambda: m.Release(self.worker_id, [task.task_id]))
            return
        finally:
            self._free_slot(task.task_id)
        self.failing = 0
        batch = m.TrajectoryBatch.from_trajectories(trajs)
        try:
            reply = await self.rpc(lambda: m.Commit(self.worker_id, task.task_id, batch, self.versions()))
        except RemoteError as e:
            if e.code != "not_holder":
                raise
            # this worker was silent past its lease (hung, cut off) and the task went to another
            log.warning("task %d: leased to another worker meanwhile; this episode is dropped", task.task_id)
            return
        self.committed += 1
        # the worker's own ledger of acknowledged commits, independent of the rank's journal
        self.record(self.acks, {"task": task.task_id, "status": reply.status, "sids": reply.sample_ids})

    @staticmethod
    def record(ledger: Path, entry: dict[str, Any]) -> None:
        """A line of one of the worker's own ledgers. They witness what the rank stored and
        are not the record of it: a line the disk has no room for is logged and left out,
        never half-written, and the episode goes on."""
        try:
            append_json_line(ledger, entry)
        except OSError as e:
            log.warning("%s: line not written (%s): %s", ledger.name, e, entry)

    def _free_slot(self, task_id: int) -> None:
        self.generating.discard(task_id)
        self.slot_freed.set()

    async def run(self) -> None:
        cfg = self.cfg
        hide_in_every_sandbox(str(self.rundir.path))  # tools, graders and users' rewards alike: the secret is there
        if self.own_engines:
            t0 = time.perf_counter()
            self.engines = build_engines(self.rundir, self.policies)
            self.engine_load_s = time.perf_counter() - t0
        # torch: only after the engine's library set its threads
        from astraflow.weights import collective
        from astraflow.weights.follower import Follower

        self.followers = {p: Follower(self.rundir.path / "weights" / p) for p in self.policies}
        self.hardware = hardware.describe()
        self.acks = self.rundir.path / "logs" / f"acks-{self.base_id}.jsonl"
        self.failures = self.rundir.path / "logs" / f"{FAILURES_PREFIX}{self.base_id}.jsonl"
        tokenizer = run_tokenizer(self.rundir)
        self.workflow = WORKFLOWS[cfg.tasks.workflow].run
        self.ctx = episode_context(cfg, self.engines, tokenizer, np.random.default_rng([cfg.run.seed, os.getpid()]),
                                   environment=await self.environment(), tools=Sandbox())
        self.client = AsyncClient(wait_rendezvous(self.rundir.path)["address"], self.rundir.read_secret(), timeout_s=10)
        loop = self.loop = asyncio.get_running_loop()
        for policy in self.policies:
            collective.listen(self.rundir.path, policy, cfg.weights, lambda *v, p=policy: self.receive(p, *v))
        background = []
        try:
            await self.rpc(lambda: m.Heartbeat(self.worker_id))  # registers
            background = [loop.create_task(self.heartbeat_loop()), loop.create_task(self.weights_loop()),
                          loop.create_task(self.follow_loop())]
            await self.lease_loop()
        except WorkerStopped:
            log.info("stopped while the dataflow rank did not answer")
        finally:
            for t in background:
                t.cancel()
            await self.hand_back()
            # the worker's own ledger, for tests and post-mortems: what the rank acknowledged
            log.info("commits acknowledged: %d, episodes handed back after an environment or tool failure: %s, "
                     "rewards failed: %s", self.committed, dict(self.episode_failures), dict(self.ctx.reward.failures))
            if self.own_engines:
                for e in self.engines.values():
                    e.close()
            if self.ctx.environment is not None:
                await self.ctx.environment.close()
            self.client.close()

    async def lease_loop(self) -> None:
        while not self.stopping:
            for tid in [t for t, task in self.inflight.items() if task.done()]:
                self.leased_at.pop(tid, None)
                self.inflight.pop(tid).result()  # re-raises a workflow bug instead of hiding it
            concurrency = self.cfg.rollout.concurrency
            free = min(concurrency - len(self.generating), 2 * concurrency - len(self.inflight))
            if time.monotonic() < self.pause_until:
                free = 0
                if not self.inflight:
                    await asyncio.sleep(self.pause_until - time.monotonic())
            if free > 0:
                held = self.versions()
                reply = await self.rpc(lambda: m.Lease(self.worker_id, free, held))
                for task in reply.tasks:
                    self.generating.add(task.task_id)
                    self.leased_at[task.task_id] = time.monotonic()
                    self.inflight[task.task_id] = asyncio.get_running_loop().create_task(self.episode(task))
                if reply.reason == "exhausted" and not self.inflight:
                    log.info("no tasks left: done after %d commits", self.committed)
                    return
                if reply.reason == "retire":
                    await self.retire()
                    return
                if reply.tasks:
                    self.lease_backoff.reset()
                    continue
                if reply.reason == "stale_weights":  # the reply's `latest` woke the weights loop:
                    await self.weights_changed(held, reply.retry_after_s)  # ask again once they are in
                elif reply.reason in OPEN_ENDED:  # no telling when: later and later (protocol/backoff.py)
                    await asyncio.sleep(self.lease_backoff.delay(reply.retry_after_s))
                else:  # a sync round's wait: it ends with a step, and the round starts at once
                    await asyncio.sleep(max(0.02, reply.retry_after_s))
            if self.inflight:
                self.slot_freed.clear()
                waits = [asyncio.ensure_future(self.slot_freed.wait()), *self.inflight.values()]
                await asyncio.wait(waits, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                waits[0].cancel()

    async def retire(self) -> None:
        """Drained by the launcher: finish the episodes in flight (for a while), then leave."""
        log.info("retiring: finishing %d episodes in flight", len(self.inflight))
        if self.inflight:
            await asyncio.wait(list(self.inflight.values()), timeout=m.RETIRE_GRACE_S)

    async def hand_back(self) -> None:
        pending = [t for t, task in self.inflight.items() if not task.done()]
        for task in self.inflight.values():
            task.cancel()
        if self.worker_id:
            try:
                await self.client.call(m.Release(self.worker_id, pending, leaving=True), timeout_s=5)
                log.info("left the pool, handing back %d leases", len(pending))
            except (TimeoutError, RemoteError) as e:
                log.warning("could not hand back leases (%s); they will expire", e)

    def stop(self) -> None:
        log.info("stop requested: handing back leases")
        self.stopping = True


def run_until_stopped(stop: Callable[[], None], serve: Callable[[], Awaitable[None]]) -> None:
    """Run `serve()`; SIGTERM, Ctrl-C and Slurm's warning signal (SIGUSR1) all call `stop`:
    hand back and leave. Young objects are collected rarely meanwhile (`heap.serving`)."""
    serving()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.add_signal_handler(sig, stop)
        await serve()

    asyncio.run(main())


def run_worker(run_dir: str, policies: list[str], worker_id: str | None) -> None:
    run = RunDir.open(run_dir)
    worker = RolloutWorker(run, policies or list(run.config.policy_names), worker_id or rollout_worker_id())
    run_until_stopped(worker.stop, worker.run)
