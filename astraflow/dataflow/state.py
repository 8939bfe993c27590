"""The dataflow rank's state machine: one method per request, no sockets, no threads.

`handle(request, now)` returns the reply, or `None` for a batch request that must wait
(the server parks it and calls `handle` again later). Nothing here is acknowledged before the
server has flushed the store and the journal: the server sends replies only after
`flush()`, so a reply never promises something a SIGKILL could take back.

Recovery (`recover()`) rebuilds everything from the shards and the journal: committed tasks
and samples from the shards, consumed steps, trainer restarts, published weights, worker
restart counters and the task high-water mark from the journal.
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
from astraflow.dataflow.buffers import (CONSUMED, FILTERED, READY, SERVED, PolicyBuffer, cached_mb, group_stats,
                                       grouped_stats)
from astraflow.dataflow.leases import TaskSet, TaskTable
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
from astraflow.store.journal import Journal, replay
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
RECOVERY_COLUMNS = ("sample_id", "task_id", "policy", "version_min", "reward", "guided", "length")
RECOVERY_SLICE_ROWS = 1 << 19  # rows recovered at a time (the arithmetic holds ~100 bytes a row)


MB = 1 << 20


class StoreFull(StoreStop):
    """The run directory's filesystem is (nearly) full: the rank stops before writing."""


class ShardDamaged(StoreStop):
    """A shard could not be read back while serving: the rank records it in the journal and
    stops; its restart quarantines the shard (its tasks are handed out again)."""


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
        shard, in whole-array operations) and the journal (read twice, line by line, never
        held whole): 10 M stored samples are a few hundred MB of columns (`samples.py`)."""
        journal = self.run_dir / "journal"
        # the journal first: it names shards found damaged while serving, which go to quarantine
        damaged, first_start, stranger, sample_hwm = self._scan_journal(journal)
        self._check_journal_whole(first_start)
        # a config that no longer matches the stored data is refused before anything is moved
        shards = self.store.recover(damaged, RECOVERY_COLUMNS)
        if stranger is not None:
            self._refuse_journal_policy(stranger)
        self.samples.reserve(sample_hwm, exact=True)  # every id handed out is below it
        done = TaskSet()
        uninformative: dict[int, bool] = {}  # task -> every group it produced was filtered (prompt selection)
        for idx, reader, rows in shards:
            tids = rows["task_id"]
            lo = 0
            while lo < len(tids):  # in slices of whole tasks, to bound the memory of the arithmetic
                hi = min(len(tids), lo + RECOVERY_SLICE_ROWS)
                while hi < len(tids) and tids[hi] == tids[hi - 1]:
                    hi += 1
                self._recover_rows(idx, lo, reader.policy_names, {c: v[lo:hi] for c, v in rows.items()}, done,
                                   uninformative)
                lo = hi
            del rows, tids  # not held while the next shard is read
        for tid in sorted(uninformative):  # in task order, as the tasks were committed (about)
            self.selection.observe(tid, uninformative[tid])
        high_water = 0
        served: dict[str, dict[int, np.ndarray]] = {p: {} for p in self.policy_names}  # not yet consumed
        for ev in replay(journal):
            kind = ev.get("ev")
            if kind == "start":
                self.incarnation = ev["incarnation"]
            elif kind == "samples":
                self.sample_hwm = max(self.sample_hwm, ev["hwm"])
            elif kind == "tasks":
                high_water = max(high_water, ev["hwm"])
            elif kind == "register":
                self.workers.restarts[ev["base"]] = ev["k"]
            elif kind == "published":
                self.weights.publish(ev["policy"], ev["version"], ev["uri"], ev["pinned"], ev.get("full", True),
                                     ev.get("base", ""), delete=False)
            elif kind == "ready":  # a restarted trainer: what it was served went back to the buffer
                self.buffers[ev["policy"]].trainer_step = ev["resume_step"]
                served[ev["policy"]].clear()
            elif kind == "served":
                served[ev["policy"]][ev["step"]] = present = self._present(ev["policy"], ev["ids"])
                self.buffers[ev["policy"]].counts["served"] += len(present)  # as live: every serving
            elif kind == "consumed":
                served[ev["policy"]].pop(ev["step"], None)
                buf = self.buffers[ev["policy"]]
                present = self._present(ev["policy"], ev["ids"])
                self.lost_samples += len(ev["ids"]) - len(present)
                self.samples.state[present] = CONSUMED
                buf.consumed[ev["step"]] = present
                buf.trainer_step = max(buf.trainer_step, ev["step"])
        for policy, steps in served.items():
            for step, present in steps.items():
                self.samples.state[present] = SERVED
                self.buffers[policy].served[step] = present
        for buf in self.buffers.values():
            buf.restore()
        self.task_hwm = high_water
        self.tasks.recover(done, high_water)
        self.incarnation += 1
        # Sample ids are never reused, not even those of a shard lost since: a new incarnation
        # starts above every id the journal says was handed out (journalled in blocks).
        self.next_sample_id = max(self.next_sample_id, self.sample_hwm)
        self.journal.append("start", incarnation=self.incarnation, time=time.time(), first_sample=self.next_sample_id)
        self.flush()
        log.info("recovered: %d tasks done, %d samples, %d queued tasks, %d quarantined shards",
                 len(done), self.next_sample_id, len(self.tasks.queued), len(self.store.quarantined))

    def _recover_rows(self, idx: int, first_row: int, names: tuple[str, ...], rows: dict[str, np.ndarray],
                      done: TaskSet, uninformative: dict[int, bool]) -> None:
        """Consecutive rows of shard `idx`, from `first_row`, holding whole tasks: their samples
        into the table, with their groups' advantages. A commit's rows are appended as one
        batch and a shard rotates only between flushes, so a task's rows are consecutive in one
        shard, and a group (a task's samples of one policy) is among them."""
        n = len(rows["sample_id"])
        to_run = np.array([self.policy_index[name] for name in names], np.int8)
        policy = to_run[rows["policy"]]
        order = np.lexsort((policy, rows["task_id"]))  # stable: a group's rows stay in commit order
        tids, pols = rows["task_id"][order], policy[order]
        first = np.ones(n, bool)
        first[1:] = (tids[1:] != tids[:-1]) | (pols[1:] != pols[:-1])
        starts = np.flatnonzero(first)
        sizes = np.diff(np.append(starts, n))
        group_policy = pols[starts]
        settings = [self.cfg.policy(p) for p in self.policy_names]
        scale = np.array([c.advantage_std for c in settings])[group_policy]
        mean, std, adv = grouped_stats(rows["reward"][order], starts, scale)
        filtered = np.array([c.filter_zero_advantage for c in settings])[group_policy] & (sizes > 1) & (std == 0.0)
        sids = rows["sample_id"][order]
        self.samples.put(sids, policy=pols, state=np.where(np.repeat(filtered, sizes), FILTERED, READY), task_id=tids,
                         version_min=rows["version_min"][order], advantage=adv, group_mean=np.repeat(mean, sizes),
                         group_std=np.repeat(std, sizes), shard=idx, row=first_row + order,
                         tokens=rows["length"][order])
        guided = np.bincount(policy, weights=rows["guided"], minlength=len(self.policy_names))
        for name, buf in self.buffers.items():
            buf.counts["guided"] += int(guided[buf.index])
        done.add_many(np.unique(tids))
        self.next_sample_id = max(self.next_sample_id, int(sids.max()) + 1)
        if self.selection.on:
            task_first = np.flatnonzero(np.append(True, tids[starts][1:] != tids[starts][:-1]))
            for tid, zero in zip(tids[starts][task_first].tolist(),
                                 np.logical_and.reduceat(filtered, task_first).tolist()):
                uninformative[tid] = uninformative.get(tid, True) and zero

    def _present(self, policy: str, ids: list[int]) -> np.ndarray:
        """Of a journal event's sample ids, those stored (a lost shard takes its samples along)."""
        ids = np.asarray(ids, np.int64)
        return ids[self.samples.present(ids, self.policy_index[policy])]

    def _scan_journal(self, journal: Path
                      ) -> tuple[dict[str, str], dict[str, Any] | None, dict[str, Any] | None, int]:
        """One pass over the journal before anything is recovered: the shards found damaged
        while serving (name -> why), the first `start` event, the first event naming a policy
        the config does not have, and the sample-id high-water mark."""
        damaged: dict[str, str] = {}
        first_start = stranger = None
        sample_hwm = 0
        for ev in replay(journal):
            kind = ev.get("ev")
            if kind == "damaged":
                damaged[ev["shard"]] = f"found damaged while serving: {ev['why']}"
            elif kind == "start" and first_start is None:
                first_start = ev
            elif kind == "samples":
                sample_hwm = max(sample_hwm, ev["hwm"])
            if stranger is None and "policy" in ev and ev["policy"] not in self.policy_index:
                stranger = ev
        return damaged, first_start, stranger, sample_hwm

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
