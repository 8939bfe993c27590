"""The dataflow rank's state machine: one method per request, no sockets, no threads.

`handle(request, now)` returns the reply, or `None` for a batch request that must wait
(the server parks it and calls `handle` again later). Nothing here is acknowledged before the
server has flushed the store and the journal: the server sends replies only after
`flush()`, so a reply never promises something a SIGKILL could take back.

Recovery (`recover()`) rebuilds everything from the shards and the journal: committed tasks
and samples from the shards, consumed steps, trainer restarts, published weights, worker
restart counters and the task high-water mark from the journal; as a fold (recovery.py)
resumed from the compact state, if one still describes the run, reading only what came after it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.config.schema import Config
from astraflow.dataflow import schedule
from astraflow.dataflow.buffers import READY, PolicyBuffer, cached_mb, group_stats
from astraflow.dataflow.leases import TaskTable
from astraflow.dataflow.recovery import COMPACT_STATE, RECOVERY_COLUMNS, Fold
from astraflow.dataflow.samples import SampleTable
from astraflow.dataflow.selection import PromptSelection
from astraflow.dataflow.space import FreeSpace
from astraflow.dataflow.status import WaitTracker, build_status
from astraflow.dataflow.validate import InvalidField, Vocabulary, check_commit, check_versions, records_per_commit
from astraflow.tasks.sources import TaskSource
from astraflow.dataflow.weights import WeightRegistry
from astraflow.dataflow.workers import WorkerRegistry
from astraflow.models import base_model_dir
from astraflow.protocol import messages as m
from astraflow.store.errors import StoreRefused, StoreStop
from astraflow.store.journal import Journal
from astraflow.store.reader import ShardCorrupt
from astraflow.store.schema import TOKEN_COLUMNS
from astraflow.store.shards import ShardStore
from astraflow.store.writer import RowBatch, StoreOptions, list_shards

log = logging.getLogger(__name__)

TASK_HWM_BLOCK = 1024  # task ids are journalled in blocks: one journal line per 1024 tasks
SAMPLE_HWM_BLOCK = 1 << 16  # sample ids likewise
STARVING_S = 30.0  # a trainer waiting this long for a batch gets a warning saying why, this often
# Bounds on what a peer asks for (a count or a version beyond what the rank knows is refused):
MAX_CAPACITY = 4096  # tasks one worker may hold at once (its registered capacity; Lease n <= it)
STEPS_AHEAD = 4  # a batch request is for a consumed step (a replay), a served one, or at most
# this many steps past the trainer's last acknowledged one (its next, or a prefetched one)


MB = 1 << 20


class StoreFull(StoreStop):
    """The run directory's filesystem is (nearly) full: the rank stops before writing."""


class ShardDamaged(StoreStop):
    """A shard could not be read back while serving: the rank records it in the journal and
    stops; its restart quarantines the shard (its tasks are handed out again)."""


class StaleCompactState(Exception):
    """The compact state covers a shard that recovery found damaged or gone: it is dropped and
    everything is replayed."""


class RequestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def store_options(cfg: Config) -> StoreOptions:
    s = cfg.store
    return StoreOptions(compression=s.compression, gzip_level=s.gzip_level,
                        shard_max_bytes=int(s.shard_max_mb * (1 << 20)), chunk_tokens=s.chunk_tokens,
                        locking=s.locking, fsync=s.fsync, max_open_shards=s.max_open_shards)


class DataflowState:
    def __init__(self, run_dir: Path, cfg: Config, clock=time.monotonic) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.clock = clock
        self.started = clock()
        self.policy_names = cfg.policy_names
        self.policy_index = {p: i for i, p in enumerate(self.policy_names)}
        self.source = TaskSource(cfg.tasks)
        self.tasks = TaskTable(limit=self.source.limit)
        self.selection = PromptSelection(cfg.selection, cfg.run.seed, self.source.index)
        self.samples = SampleTable()  # every stored sample's bookkeeping, shared by the buffers
        self.buffers = {p.name: PolicyBuffer(p.name, p.max_staleness, p.buffer_capacity, cfg.trainer_for(p.name).steps,
                                              newest_first=p.serve_order == "newest", index=i, samples=self.samples)
                        for i, p in enumerate(cfg.policies)}
        self.workers = WorkerRegistry()
        self.weights = WeightRegistry(self.run_dir / "weights", {p.name: p.keep_versions for p in cfg.policies})
        self.store = ShardStore(self.run_dir / "shards", self.policy_names, store_options(cfg))
        self.journal = Journal(self.run_dir / "journal", fsync=cfg.store.fsync)
        self.space = FreeSpace(self.run_dir, clock)
        self.vocabulary = Vocabulary(base_model_dir(self.run_dir, cfg.model.path))  # read at the first commit
        self.max_records = records_per_commit(cfg)
        self.waits = {p: WaitTracker() for p in self.policy_names}
        self.trainers: dict[str, dict[str, Any]] = {}
        self.counters: Counter[str] = Counter()
        self.starving: dict[str, tuple[float, dict[str, int]]] = {}  # policy: (last warning, counts then)
        self.lost_samples = 0
        self.next_sample_id = 0
        self.sample_hwm = 0
        self.task_hwm = 0
        self.incarnation = 0
        self.compact_used = False  # recovery resumed from the compact state (recovery.py)
        self.recovery_s = 0.0  # how long the last `recover()` took
        self._handlers = {
            m.Register: self._register, m.Heartbeat: self._heartbeat, m.Lease: self._lease,
            m.Renew: self._renew, m.Commit: self._commit, m.Release: self._release,
            m.Weights: self._weights, m.Ready: self._ready, m.Batch: self._batch,
            m.Consumed: self._consumed, m.Published: self._published, m.Status: self._status,
            m.Stopped: self._stopped, m.Drain: self._drain,
        }
        self.draining: set[str] = set()  # worker base ids being retired (not journalled: a
        # restarted rank forgets them and the launcher, which cancels their jobs anyway, re-sends)

    # ================================================================ recovery
    def recover(self) -> None:
        """Rebuild the state from the shards (a few columns of their row tables, shard by
        shard, in whole-array operations) and the journal (read once, line by line, never held
        whole), as a fold (recovery.py): resumed from the compact state where it still
        describes the run, so that only the shards and journal lines it does not cover are
        read; else from nothing. 10 M stored samples are a few hundred MB of columns."""
        started = time.perf_counter()
        fold = self._compact_state()
        try:
            self._fold_all(fold)
        except StaleCompactState as e:  # a shard it covers was found damaged just now, or is gone
            log.warning("compact state not used: %s; replaying every shard and the whole journal", e)
            self.compact_used = False
            fold = Fold(self.cfg)
            self._fold_all(fold)
        self._install(fold)
        # Sample ids are never reused, not even those of a shard lost since: a new incarnation
        # starts above every id the journal says was handed out (journalled in blocks).
        self.journal.append("start", incarnation=self.incarnation, time=time.time(), first_sample=self.next_sample_id)
        self.flush()
        self.recovery_s = time.perf_counter() - started
        log.info("recovered in %.1fs: %d tasks done, %d samples, %d queued tasks, %d quarantined shards%s",
                 self.recovery_s, len(fold.done), self.next_sample_id, len(self.tasks.queued),
                 len(self.store.quarantined), " (resumed from the compact state)" if self.compact_used else "")

    def _compact_state(self) -> Fold:
        """The compact state as a fold to resume, if it still describes the journal; else an empty fold."""
        path = self.journal.path.parent / COMPACT_STATE
        if not path.exists():
            return Fold(self.cfg)
        try:
            fold = Fold.load(path, self.cfg)
        except ValueError as e:
            log.warning("%s; replaying every shard and the whole journal", e)
            return Fold(self.cfg)
        why = fold.why_stale(self.journal.path)
        if why is not None:
            log.warning("compact state %s not used: %s; replaying every shard and the whole journal", path, why)
            return Fold(self.cfg)
        self.compact_used = True
        return fold

    def _fold_all(self, fold: Fold) -> None:
        """The journal (first: it names shards found damaged while serving, which go to
        quarantine), then every shard's rows that `fold` does not cover."""
        fold.fold_journal(self.journal.path)
        self._check_journal_whole(fold.first_start)
        covered = dict(fold.rows_covered)
        damaged = sorted(set(covered) & set(fold.damaged))
        if damaged:
            raise StaleCompactState(f"shard {damaged[0]} was found damaged after it was folded")
        # a config that no longer matches the stored data is refused before anything is moved
        shards = self.store.recover(fold.damaged, RECOVERY_COLUMNS, skip=covered)
        if fold.stranger is not None:
            self._refuse_journal_policy(fold.stranger)
        fold.samples.reserve(fold.sample_hwm, exact=True)  # every id handed out is below it
        for idx, reader, rows in shards:
            name = reader.path.name
            if name in covered:  # its rows were skipped: none read
                if reader.n_rows != covered.pop(name):
                    raise StaleCompactState(f"shard {name} holds {reader.n_rows} good rows, "
                                            f"{fold.rows_covered[name]} when it was folded")
                continue
            fold.fold_shard(name, idx, reader.policy_names, rows)
            del rows  # not held while the next shard is read
        if covered:
            raise StaleCompactState(f"shard {sorted(covered)[0]} is gone (quarantined or removed)")

    def _install(self, fold: Fold) -> None:
        """Take over a complete fold: the table, the ledgers, the counts, the tasks."""
        consumed, served, self.lost_samples = fold.resolve()
        self.samples = fold.samples
        for buf in self.buffers.values():
            i = buf.index
            buf.samples = fold.samples
            buf.counts["guided"] += int(fold.guided[i])
            buf.counts["served"] += int(fold.served_count[i])  # as live: every serving
            buf.trainer_step = fold.trainer_step[i]
            buf.consumed, buf.served = consumed[i], served[i]
            buf.restore()
        for tid in sorted(fold.uninformative):  # in task order, as the tasks were committed (about)
            self.selection.observe(tid, fold.uninformative[tid])
        self.workers.restarts.update(fold.restarts)
        for ev in fold.published:
            self.weights.publish(ev["policy"], ev["version"], ev["uri"], ev["pinned"], ev.get("full", True),
                                 ev.get("base", ""), delete=False)
        self.sample_hwm, self.task_hwm = fold.sample_hwm, fold.task_hwm
        self.tasks.recover(fold.done, fold.task_hwm)
        self.incarnation = fold.incarnation + 1
        self.next_sample_id = max(fold.next_sample_id, fold.sample_hwm)

    def _check_journal_whole(self, first_start: dict[str, Any] | None) -> None:
        """The journal must go back to the run's first start: a rank that began a new one next to
        existing shards would serve consumed samples again and lose the trainers' lineage (a
        journal deleted mid-run: 128 samples trained twice, steps 1-60 missing)."""
        path = self.journal.path
        shards = self.store.dir
        stored = next(iter(list_shards(shards)), None) or next(iter((shards / "quarantine").glob("shard-*.h5")), None)
        if first_start is not None and first_start.get("first_sample", 0) > 0:
            why = (f"begins with incarnation {first_start['incarnation']} at sample {first_start['first_sample']}, "
                   f"not at the run's start")
        elif first_start is None and stored is not None:
            why = f"is missing or empty but {stored.name} holds the run's data"
        else:
            return
        rescued = sorted(path.parent.glob(f"{path.name}.rescued-*"))
        hint = (f"restore it (the rank rescued a copy when it saw it go: {rescued[-1]})" if rescued
                else "restore it from a copy, or start a new run")
        raise StoreRefused(f"{path} {why}: it was deleted or replaced, and starting from it would train samples "
                           f"again and hand out ids twice; {hint}. Nothing was moved")

    def _refuse_journal_policy(self, ev: dict[str, Any]) -> None:
        """Every policy the journal names must be in the config (else replaying it fails half-way)."""
        raise StoreRefused(
            f"{self.run_dir / 'journal' / 'journal.jsonl'} names policy {ev['policy']!r} (a {ev.get('ev')!r} "
            f"event) but the run's config names {list(self.policy_names)}: the config no longer matches "
            f"the stored data; restore the config's policies. Nothing was moved")

    def _filtered(self, policy: str, rewards: np.ndarray, std: float) -> bool:
        return self.cfg.policy(policy).filter_zero_advantage and len(rewards) > 1 and std == 0.0

    # ================================================================ dispatch
    def handle(self, request: Any, now: float | None = None, count: bool = True) -> Any:
        now = self.clock() if now is None else now
        if count:
            self.counters[type(request).__name__.lower()] += 1
        try:
            return self._handlers[type(request)](request, now)
        except RequestError as e:
            self.counters[f"error_{e.code}"] += 1
            return m.Error(e.code, str(e))

    def flush(self) -> None:
        """Make everything handled so far durable. Replies may be sent only after this.

        The turn's writes must fit with `store.min_free_mb` to spare (the room left for logs,
        checkpoints and weights on the same filesystem): HDF5 out of space inside a flush
        crashed the rank (SIGSEGV) and left rows of zeros, so the rank stops before that.
        The free space is measured at most once a second while there is plenty (space.py)."""
        need = self.store.staged_bytes() + self.journal.pending_bytes()
        keep = int(self.cfg.store.min_free_mb * MB) + need
        free = self.space.free(keep)
        if free < keep:
            raise StoreFull(f"only {free / MB:.1f} MB free under {self.run_dir}, this turn writes up to "
                            f"{need / MB:.1f} MB and store.min_free_mb={self.cfg.store.min_free_mb:g} are kept "
                            f"free: stopping before a shard or the journal is cut short; nothing unflushed was "
                            f"acknowledged. Free some space and resume the run")
        self.store.flush()
        self.journal.flush()
        self.space.wrote(need)

    def tick(self, now: float | None = None) -> None:
        """Expire leases and declare silent workers dead."""
        now = self.clock() if now is None else now
        expired = self.tasks.expire(now)
        if expired:
            self.counters["leases_expired"] += len(expired)
        for w in self.workers.sweep(now, self.cfg.dataflow.heartbeat_timeout_s):
            released = self._hand_back(w.worker_id)
            self.counters["workers_dead"] += 1
            log.warning("worker %s silent for %.0fs: declared dead, %d leases handed back",
                        w.worker_id, now - w.last_seen, released)
        self._warn_starving(now)

    def _warn_starving(self, now: float) -> None:
        """A trainer that waits and waits is a stopped run: say in the log what its samples became.

        The usual cause is a policy that answers each prompt alike (it solved the task, or it
        collapsed): every group then has zero advantage and is filtered, however fast the workers go."""
        for policy, wait in self.waits.items():
            if wait.waiting_since is None:
                self.starving.pop(policy, None)
                continue
            counts = self.buffers[policy].counts
            if policy not in self.starving:  # a wait that did not start in _batch (barrier, sync round)
                self.starving[policy] = (now, dict(counts))
                continue
            last, before = self.starving[policy]
            if now - last < STARVING_S:
                continue
            self.starving[policy] = (now, dict(counts))
            delta = {k: counts[k] - before[k] for k in ("stored", "filtered", "dropped_stale")}
            log.warning("policy %s: its trainer has waited %.0fs for a batch; in the last %.0fs %d samples were "
                        "stored, %d filtered (zero-advantage groups) and %d dropped as stale; %d ready, %d tasks "
                        "leased", policy, now - wait.waiting_since, now - last, delta["stored"], delta["filtered"],
                        delta["dropped_stale"], self.buffers[policy].buffered, len(self.tasks.leased))

    def next_deadline(self) -> float | None:
        return self.tasks.next_deadline()

    def close(self) -> None:
        """Close the store and the journal. Whatever was handled since the last `flush()` was
        never acknowledged and is dropped: after a failed flush (a full disk) writing it would
        run into what stopped the rank."""
        self.store.close(drop_staged=True)
        self.journal.close(drop_pending=True)

    # ================================================================ workers
    def _check_protocol(self, version: int) -> None:
        if version != m.PROTOCOL_VERSION:
            raise RequestError("version_mismatch",
                               f"peer speaks protocol {version}, this dataflow rank speaks "
                               f"{m.PROTOCOL_VERSION}; run the same AstraFlow version on both sides")

    def _check_policies(self, policies: list[str]) -> None:
        unknown = [p for p in policies if p not in self.policy_index]
        if unknown:
            raise RequestError("bad_request", f"unknown policies {unknown}; this run has {list(self.policy_names)}")

    def _worker(self, worker_id: str, now: float):
        info = self.workers.seen(worker_id, now)
        if info is None:
            raise RequestError("unknown_worker", f"worker {worker_id!r} is not registered (or was declared dead); register again")
        return info

    def _register(self, req: m.Register, now: float) -> m.RegisterReply:
        self._check_protocol(req.protocol_version)
        self._check_policies(req.policies)
        if not req.worker_id or not 1 <= req.capacity <= MAX_CAPACITY:
            raise RequestError("bad_request", f"worker_id must be non-empty and 1 <= capacity <= {MAX_CAPACITY}")
        info, ended = self.workers.register(req.worker_id, now, policies=tuple(req.policies), capacity=req.capacity,
                                            hardware=req.hardware, partition=req.partition, host=req.host, pid=req.pid)
        if ended is not None:  # the incarnation this one replaces: its leases go back to the queue
            self._hand_back(ended.worker_id)
        self.journal.append("register", base=req.worker_id, k=self.workers.restarts[req.worker_id],
                            worker=info.worker_id, partition=req.partition, hardware=req.hardware,
                            host=req.host, pid=req.pid, engine_load_s=req.engine_load_s, time=time.time())
        hb = self.cfg.dataflow.heartbeat_timeout_s
        return m.RegisterReply(info.worker_id, self.cfg.dataflow.lease_s, hb / 3)

    def _hand_back(self, worker_id: str) -> int:
        """Return every lease `worker_id` holds to the queue; how many there were."""
        held = [t for t, lease in self.tasks.leased.items() if lease.worker == worker_id]
        for t in held:
            self.tasks.release(t)
        return len(held)

    def _heartbeat(self, req: m.Heartbeat, now: float) -> m.HeartbeatReply:
        worker = self._worker(req.worker_id, now)
        self._check_versions(req.versions)
        worker.versions = dict(req.versions)
        return m.HeartbeatReply(self._latest())

    def _check_versions(self, versions: dict[str, int]) -> None:
        """The weights a worker says it runs: known policies, versions no newer than published."""
        try:
            check_versions(versions, self.policy_index, self._version_ceilings())
        except InvalidField as e:
            raise RequestError("bad_request", str(e)) from None

    def _latest(self) -> dict[str, int]:
        return {p: self.weights.latest(p)[0] for p in self.policy_names}

    def _lease(self, req: m.Lease, now: float) -> m.LeaseReply:
        return dataclasses.replace(self._lease_tasks(req, now), latest=self._latest())

    def _lease_tasks(self, req: m.Lease, now: float) -> m.LeaseReply:
        worker = self._worker(req.worker_id, now)
        self._check_versions(req.versions)
        worker.versions = dict(req.versions)
        needed = self.cfg.task_policies
        if worker.base in self.draining:
            return m.LeaseReply([], 0.0, "retire")
        if not set(needed) <= set(worker.policies):
            return m.LeaseReply([], 5.0, "no_matching_policies")
        for p in needed:
            latest = self.weights.latest(p)[0]
            if latest >= 0 and latest - req.versions.get(p, -1) > self.cfg.policy(p).max_staleness:
                self.counters["lease_refused_stale"] += 1
                return m.LeaseReply([], 0.5, "stale_weights")
        group = self.cfg.tasks.group_size
        n = min(max(0, req.n), worker.capacity)  # a worker holds at most its capacity's worth
        if self.cfg.schedule.mode == "sync":
            quota, why = schedule.sync_quota(self, needed, req.versions)
            if quota == 0:
                self.counters[f"lease_{why}"] += 1
                return m.LeaseReply([], schedule.SYNC_RETRY_S, why)
            n = min(n, quota)
        tasks: list[m.Task] = []
        reason = ""
        exempt = schedule.short_of_a_batch(self, needed)
        for _ in range(n):
            inflight = (len(self.tasks.leased) + 1) * group
            if not exempt and not all(self.buffers[p].has_room(inflight) for p in needed):
                reason = "backpressure"
                break
            tid = self.tasks.take()
            while tid is not None and not self.selection.keep(tid):  # a skipped id is not handed out
                tid = self.tasks.take()
            if tid is None:
                # "exhausted": nothing will ever come; "drained": leased tasks may still return
                reason = "drained" if self.tasks.leased or tasks else "exhausted"
                break
            self.tasks.lease(tid, worker.worker_id, now, self.cfg.dataflow.lease_s, req.versions)
            item = self.source.item(tid)
            tasks.append(m.Task(tid, self.cfg.dataflow.lease_s, item.prompt, item.answer, group, list(needed),
                                messages=list(item.messages), solution=item.solution, row=item.row))
        if self.tasks.next_id > self.task_hwm:
            self.task_hwm = self.tasks.next_id + TASK_HWM_BLOCK
            self.journal.append("tasks", hwm=self.task_hwm)
        if reason == "backpressure":
            self.counters["lease_backpressure"] += 1
        return m.LeaseReply(tasks, 0.0 if tasks else 0.2, reason)

    def _renew(self, req: m.Renew, now: float) -> m.RenewReply:
        self._worker(req.worker_id, now)
        renewed, lost = [], []
        for tid in req.task_ids:
            ok = self.tasks.renew(tid, req.worker_id, now, self.cfg.dataflow.lease_s)
            (renewed if ok else lost).append(tid)
        return m.RenewReply(renewed, lost, self._latest())

    def _release(self, req: m.Release, now: float) -> m.Ok:
        worker = self._worker(req.worker_id, now)
        for tid in req.task_ids:
            self.tasks.release(tid, req.worker_id)
        if req.leaving:
            self._hand_back(worker.worker_id)  # whatever it still holds (a lease it forgot about) goes back too
            self.workers.end(worker, now)
            self.journal.append("leave", worker=worker.worker_id, time=time.time())
        return m.Ok()

    def _weights(self, req: m.Weights, now: float) -> m.WeightsReply:
        self._check_policies([req.policy])
        return m.WeightsReply(*self.weights.latest(req.policy))

    # ================================================================ commits
    def _commit(self, req: m.Commit, now: float) -> m.CommitReply:
        worker = self._worker(req.worker_id, now)  # a commit is a heartbeat, from a registered worker
        tid = req.task_id
        if tid < 0 or tid >= self.tasks.next_id:
            raise RequestError("bad_request", f"task {tid} was never handed out")
        if tid in self.tasks.done:
            self.counters["duplicate_commits"] += 1
            return m.CommitReply("duplicate", [], self._latest())
        lease = self.tasks.leased.get(tid)
        if lease is not None and lease.worker != worker.worker_id:
            # Only the holder commits. A task nobody holds (its lease expired, its holder was
            # declared dead or re-registered, the rank restarted) takes a late commit from any
            # registered worker: the work is done, and the first commit wins either way.
            raise RequestError("not_holder", f"task {tid} is leased to another worker (this worker's lease expired "
                                             f"and the task was handed out again); nothing stored")
        trajs = req.trajectories
        n = len(trajs)
        if not n:
            raise RequestError("bad_request", "a commit needs at least one trajectory")
        unknown = set(trajs.policy) - set(self.policy_index)
        if unknown:
            raise RequestError("bad_request", f"trajectories.policy: unknown policies {sorted(unknown)}")
        try:
            check_commit(trajs, req.versions, self.policy_index, self._version_ceilings(), self.vocabulary.get(now),
                         self.cfg.dataflow.max_trajectory_tokens, self.max_records, self.vocabulary.path)
        except InvalidField as e:
            self.counters[f"invalid_{e.field}"] += 1
            raise RequestError("invalid_commit", f"commit of task {tid} refused, nothing stored: {e}") from None
        weight = self.selection.weight(tid)
        batch, vmin = self._row_batch(req, tid, weight)
        sids = batch.rows["sample_id"]
        rewards = batch.rows["reward"].astype(np.float64)
        policy_idx = batch.rows["policy"]
        lengths = batch.rows["length"]
        guided = batch.rows["guided"]
        locs = self.store.append(batch)
        shard, rows = locs[0][0], np.array([r for _, r in locs], np.int32)
        keep = cached_mb(self.buffers.values()) < self.cfg.dataflow.payload_cache_mb
        if not keep:
            self.counters["payload_not_cached"] += n
        uninformative = True
        for pi in np.unique(policy_idx):
            policy = self.policy_names[pi]
            members = np.flatnonzero(policy_idx == pi)
            mean, std, adv = group_stats(rewards[members], self.cfg.policy(policy).advantage_std)
            filtered = self._filtered(policy, rewards[members], std)
            uninformative &= filtered
            self.samples.put(sids[members], policy=pi, state=READY, task_id=tid, version_min=vmin[members],
                             advantage=adv, group_mean=mean, group_std=std, shard=shard, row=rows[members],
                             tokens=lengths[members])
            self.buffers[policy].add(sids[members], filtered, rewards[members], guided[members], weight,
                                     [(trajs, int(j)) for j in members] if keep else None)
        self.selection.observe(tid, uninformative)
        self.tasks.complete(tid)
        self.workers.record_commit(req.worker_id, now, n, int(lengths.sum()), self.cfg.dataflow.status_window_s)
        return m.CommitReply("stored", sids.tolist(), self._latest())

    def _version_ceilings(self) -> np.ndarray:
        """The newest weight version each policy may have generated with (its newest published
        one; 0, the starting weights, before any), and last, for token_policy -1, the largest."""
        ceilings = [max(self.weights.latest(p)[0], 0) for p in self.policy_names]
        return np.array([*ceilings, max(ceilings)], np.int64)

    def _row_batch(self, req: m.Commit, tid: int, weight: float) -> tuple[RowBatch, np.ndarray]:
        """Columns for the store, computed with whole-array operations (this is the hot path)."""
        trajs = req.trajectories
        n = len(trajs)
        starts = trajs.offsets[:-1]
        own = trajs.loss_mask.astype(bool)
        vmin = np.minimum.reduceat(np.where(own, trajs.versions, np.iinfo(np.int32).max), starts)
        vmax = np.maximum.reduceat(np.where(own, trajs.versions, -1), starts)
        has_own = np.logical_or.reduceat(own, starts)
        fallback = np.array([req.versions.get(p, -1) for p in trajs.policy], np.int32)
        vmin = np.where(has_own, vmin, fallback).astype(np.int32)
        vmax = np.where(has_own, vmax, fallback).astype(np.int32)
        sids = np.arange(self.next_sample_id, self.next_sample_id + n, dtype=np.int64)
        self.next_sample_id += n
        if self.next_sample_id > self.sample_hwm:
            self.sample_hwm = self.next_sample_id + SAMPLE_HWM_BLOCK
            self.journal.append("samples", hwm=self.sample_hwm)
        rows = {"sample_id": sids, "task_id": np.full(n, tid, np.int64), "episode_id": trajs.episode_id,
                "group_id": trajs.group_id,
                "policy": np.array([self.policy_index[p] for p in trajs.policy], np.uint8),
                "worker": np.full(n, req.worker_id.encode()[:64], dtype="S64"), "length": trajs.lengths,
                "reward": trajs.reward, "guided": np.array([bool(x.get("guided")) for x in trajs.meta], np.uint8),
                "weight": np.full(n, weight, np.float32),
                "gen_s": trajs.gen_s, "t_commit": np.full(n, time.time()),
                "version_min": vmin, "version_max": vmax,
                "version_at_commit": np.array([self.weights.latest(p)[0] for p in trajs.policy], np.int32)}
        # The versions the whole task ran with travel in each record's metadata.
        extra = {"task_versions": req.versions} if req.versions else {}
        meta = [json.dumps({**x, **extra}, separators=(",", ":"), default=str).encode() if x or extra else b""
                for x in trajs.meta]
        tokens = {c: getattr(trajs, c) for c in TOKEN_COLUMNS}
        return RowBatch(tokens, rows, meta), vmin

    # ================================================================ trainers
    def _ready(self, req: m.Ready, now: float) -> m.ReadyReply:
        self._check_protocol(req.protocol_version)
        self._check_policies([req.policy])
        acknowledged = max(self.buffers[req.policy].consumed, default=0)
        if not 0 <= req.resume_step <= acknowledged:  # a checkpoint follows its step's acknowledgement
            raise RequestError("bad_request", f"resume_step {req.resume_step}: expected 0 .. {acknowledged}, the last "
                                              f"step of {req.policy} this rank acknowledged")
        replay_steps = self.buffers[req.policy].trainer_restarted(req.resume_step)
        self.trainers[req.policy] = {"hardware": req.hardware, "partition": req.partition,
                                     "world": req.world, "resume_step": req.resume_step, "since": time.time()}
        self.journal.append("ready", policy=req.policy, resume_step=req.resume_step, hardware=req.hardware,
                            partition=req.partition, world=req.world, time=time.time())
        return m.ReadyReply(replay_steps, self.weights.latest(req.policy)[0])

    def _batch(self, req: m.Batch, now: float) -> m.BatchReply | None:
        self._check_policies([req.policy])
        buf = self.buffers[req.policy]
        self._check_batch(req, buf)
        replay = req.step in buf.consumed
        ids = buf.step_ids(req.step)
        if ids is None:
            if buf.buffered < req.n and self.tasks.exhausted and not self.tasks.leased:
                raise RequestError("exhausted", f"only {buf.buffered} samples left and no tasks remain")
            if self.cfg.schedule.barrier and schedule.barrier_blocks(self, req.policy, req.step):
                return None
            if self.cfg.schedule.mode == "sync" and not schedule.sync_round_ready(self, req.step):
                return None
            ids = buf.take(req.step, req.n, req.version)
            if ids is None:
                self.starving.setdefault(req.policy, (now, dict(buf.counts)))  # see _warn_starving
                return None
            # journalled: after a restart of the rank the trainer acknowledges exactly these
            self.journal.append("served", policy=req.policy, step=req.step, ids=ids)
        first = req.rank == 0 and req.member == 0  # one request per step: the others of its replica ask the same
        if replay and req.member == 0:
            buf.counts["replayed"] += len(ids)
        mine, table = np.asarray(ids, np.int64)[req.rank::req.world], self.samples
        generated_mean, generated_count = buf.generated_reward() if first and not replay else (0.0, 0)
        return m.BatchReply(
            req.step, replay, self._payloads(buf, mine), sample_ids=mine, task_ids=table.task_id[mine],
            advantages=table.advantage[mine], group_mean=table.group_mean[mine], group_std=table.group_std[mine],
            generated_reward_mean=generated_mean, generated_count=generated_count)

    def _check_batch(self, req: m.Batch, buf: PolicyBuffer) -> None:
        """Counts, steps and versions within what the rank knows: one request for n=10**6
        parked forever and was retried every turn, one for version 2**62 dropped the whole
        buffer as stale. The server parks one request per (policy, step, rank, member), so at
        most trainer.world x STEPS_AHEAD per policy."""
        t = self.cfg.trainer_for(req.policy)
        most = max(buf.capacity, t.batch_size)
        replica = t.tp * t.pp
        world = t.world // replica
        if not 1 <= req.n <= most:
            raise RequestError("bad_request", f"n {req.n}: expected 1 .. {most} (buffer_capacity, batch_size)")
        if not 1 <= req.world <= world or not 0 <= req.rank < req.world:
            raise RequestError("bad_request", f"rank {req.rank} of world {req.world}: expected 0 <= rank < world "
                                              f"<= trainer.world / (tp x pp) ({world})")
        if not 0 <= req.member < replica:
            raise RequestError("bad_request", f"member {req.member}: expected 0 .. {replica - 1} (tp x pp ranks per "
                                              f"model replica)")
        newest = max(self.weights.latest(req.policy)[0], 0) + 1
        if not 0 <= req.version <= newest:
            raise RequestError("bad_request", f"version {req.version}: expected 0 .. {newest}, one past the newest "
                                              f"published version")
        last = buf.trainer_step + STEPS_AHEAD
        if req.step not in buf.consumed and req.step not in buf.served and not 1 <= req.step <= last:
            raise RequestError("bad_request", f"step {req.step}: expected a step already served, or 1 .. {last} "
                                              f"(at most {STEPS_AHEAD} past the last acknowledged step)")

    def _payloads(self, buf: PolicyBuffer, ids: np.ndarray) -> m.TrajectoryBatch:
        """The samples' trajectories as one batch: from memory where cached, the others read
        back from their shards in one batched read (`ShardStore.read`)."""
        cached = [buf.payloads.get(sid) for sid in ids.tolist()]
        missing = [(int(self.samples.shard[sid]), int(self.samples.row[sid]))
                   for sid, payload in zip(ids.tolist(), cached) if payload is None]
        if not self.store.written(missing):
            # committed this turn and not cached (a parked request retried after the commits):
            # a reader sees flushed rows only, and one past the row table looked like damage
            self.flush()
        try:
            records = self.store.read(missing) if missing else []
        except ShardCorrupt as e:
            # written now: the restart must learn of it, and nothing else is acknowledged
            self.journal.append("damaged", shard=e.path.name, why=e.why, time=time.time())
            self.journal.flush()
            raise ShardDamaged(f"{e.path.name} cannot be read back ({e.why}); recorded in the journal: the "
                               f"rank stops and its restart quarantines the shard (its tasks are handed "
                               f"out again)") from None
        read = m.TrajectoryBatch.from_trajectories([
            m.Trajectory(r["policy"], r["tokens"], r["logprobs"], r["loss_mask"], r["versions"], r["token_policy"],
                         r["reward"], r["episode_id"], r["group_id"], r["gen_s"], r["meta"]) for r in records])
        reread = iter(range(len(records)))
        return m.TrajectoryBatch.gather([payload if payload is not None else (read, next(reread))
                                         for payload in cached])

    def _consumed(self, req: m.Consumed, now: float) -> m.Ok:
        self._check_policies([req.policy])
        err = self.buffers[req.policy].consume(req.step, req.sample_ids)
        if err:
            raise RequestError("conflict", f"consumed(policy={req.policy}, step={req.step}): {err}")
        # task ids too: an audit can then tell a lost sample from one whose task was regenerated
        ids = np.asarray(req.sample_ids, np.int64)
        self.journal.append("consumed", policy=req.policy, step=req.step, ids=ids.tolist(),
                            tasks=self.samples.task_id[ids].tolist())
        return m.Ok()

    def _published(self, req: m.Published, now: float) -> m.Ok:
        self._check_policies([req.policy])
        newest = max(self.weights.latest(req.policy)[0], 0) + 1
        if not 0 <= req.version <= newest:  # versions are published in order, one per step
            raise RequestError("bad_request", f"version {req.version}: expected 0 .. {newest}, one past the newest "
                                              f"published version")
        self.weights.publish(req.policy, req.version, req.uri, req.pinned, req.full, req.base)
        self.buffers[req.policy].trainer_version = req.version
        self.journal.append("published", policy=req.policy, version=req.version, uri=req.uri,
                            pinned=req.pinned, full=req.full, base=req.base, time=time.time())
        return m.Ok()

    def _stopped(self, req: m.Stopped, now: float) -> m.Ok:
        self._check_policies([req.policy])
        self.trainers.setdefault(req.policy, {})["stopped_step"] = req.step  # until its next `Ready`
        self.journal.append("stopped", policy=req.policy, step=req.step, time=time.time())
        return m.Ok()

    def _drain(self, req: m.Drain, now: float) -> m.Ok:
        self.draining.update(req.worker_bases)
        self.journal.append("drain", bases=list(req.worker_bases), time=time.time())
        return m.Ok()

    def _status(self, req: m.Status, now: float) -> m.StatusReply:
        return m.StatusReply(build_status(self, now))
