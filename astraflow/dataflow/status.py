"""The `status` reply: a JSON document with a versioned schema.

Schema (schema_version 1), consumed by `astraflow inspect`, `astraflow status` and the
elastic controller:
    schema_version, time, uptime_s, incarnation
    workers:  alive, dead (in the last 5 minutes: then forgotten), by_partition{p: n},
              list[{id, alive, partition, hardware, host, pid, base,
              draining, policies, leases, trajectories, tokens, trajectories_per_s,
              tokens_per_s, versions}]
    tasks:    created, queued, leased, done, requeued, exhausted, skipped (prompt selection)
    policies: {name: {stored, served, consumed, dropped_stale, filtered, replayed, unused, buffered,
              latest_version, trainer_step, trainer_wait_fraction, trainer}}
    throughput: {per_partition: {p: {trajectories_per_s, tokens_per_s}}}
    store:    active_shard, quarantined[], torn_rows{shard: rows of a torn tail, ignored}, lost_samples,
              open_shards (held for reading), retries (transient errors on a shard tried again),
              free_space_checks (statfs calls of the flush guard)
    protocol: {counters: {request kind or error code: n}}
    process:  cpu_user_s, cpu_sys_s, peak_rss_mb (of the dataflow rank)
Rates and `trainer_wait_fraction` are over the last `dataflow.status_window_s` seconds.
"""
from __future__ import annotations

import resource
import time
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Any

from astraflow.dataflow.buffers import cached_mb

if TYPE_CHECKING:
    from astraflow.dataflow.state import DataflowState

SCHEMA_VERSION = 1


class WaitTracker:
    """Time a policy's trainer spent waiting for a batch, as a fraction of a sliding window."""

    def __init__(self) -> None:
        self.intervals: deque[tuple[float, float]] = deque()
        self.waiting_since: float | None = None

    def start(self, now: float) -> None:
        if self.waiting_since is None:
            self.waiting_since = now

    def stop(self, now: float) -> None:
        if self.waiting_since is not None:
            self.intervals.append((self.waiting_since, now))
            self.waiting_since = None

    def fraction(self, now: float, window: float) -> float:
        lo = now - window
        while self.intervals and self.intervals[0][1] < lo:
            self.intervals.popleft()
        waited = sum(min(e, now) - max(s, lo) for s, e in self.intervals if e > lo)
        if self.waiting_since is not None:
            waited += now - max(self.waiting_since, lo)
        return max(0.0, min(1.0, waited / window))


def build_status(state: "DataflowState", now: float) -> dict[str, Any]:
    window = state.cfg.dataflow.status_window_s
    span = max(1e-9, min(window, now - state.started))
    leases_by_worker: dict[str, int] = defaultdict(int)
    for lease in state.tasks.leased.values():
        leases_by_worker[lease.worker] += 1
    workers, by_partition = [], defaultdict(int)
    part_rates: dict[str, dict[str, float]] = defaultdict(lambda: {"trajectories_per_s": 0.0, "tokens_per_s": 0.0})
    for w in state.workers.workers.values():
        recent = [(t, n, k) for t, n, k in w.recent if t >= now - window]
        traj_s = sum(n for _, n, _ in recent) / span
        tok_s = sum(k for _, _, k in recent) / span
        if w.alive:
            by_partition[w.partition or "local"] += 1
        part_rates[w.partition or "local"]["trajectories_per_s"] += traj_s
        part_rates[w.partition or "local"]["tokens_per_s"] += tok_s
        workers.append({"id": w.worker_id, "alive": w.alive, "partition": w.partition, "hardware": w.hardware,
                        "host": w.host, "pid": w.pid, "base": w.base, "draining": w.base in state.draining, "policies": list(w.policies), "leases": leases_by_worker[w.worker_id],
                        "trajectories": w.trajectories, "tokens": w.tokens,
                        "trajectories_per_s": traj_s, "tokens_per_s": tok_s, "versions": w.versions})
    policies = {}
    for name, buf in state.buffers.items():
        policies[name] = {**buf.counts, "buffered": buf.buffered,
                          "latest_version": state.weights.latest(name)[0],
                          "trainer_step": buf.trainer_step,
                          "trainer_wait_fraction": state.waits[name].fraction(now, span),
                          "trainer": state.trainers.get(name)}
    alive = sum(1 for w in state.workers.workers.values() if w.alive)
    return {
        "schema_version": SCHEMA_VERSION,
        "time": time.time(),
        "uptime_s": now - state.started,
        "incarnation": state.incarnation,
        "workers": {"alive": alive, "dead": len(state.workers.workers) - alive,
                    "by_partition": dict(by_partition), "list": workers},
        "tasks": {"created": state.tasks.next_id, "queued": len(state.tasks.queued),
                  "leased": len(state.tasks.leased), "done": len(state.tasks.done),
                  "requeued": state.tasks.requeued, "exhausted": state.tasks.exhausted,
                  "skipped": state.selection.skipped},
        "policies": policies,
        "throughput": {"per_partition": dict(part_rates)},
        "store": {"active_shard": state.store.active_shard, "quarantined": list(state.store.quarantined),
                  "torn_rows": dict(state.store.torn_rows), "lost_samples": state.lost_samples,
                  "open_shards": state.store.open_shards, "retries": state.store.retries,
                  "free_space_checks": state.space.measurements,
                  "payload_cache_mb": cached_mb(state.buffers.values()),
                  "recovery": {"s": state.recovery_s, "from_compact_state": state.compact_used}},
        "protocol": {"counters": dict(state.counters)},
        "process": _process_usage(),
    }


def _process_usage() -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_user_s": ru.ru_utime, "cpu_sys_s": ru.ru_stime, "peak_rss_mb": peak_rss_mb(ru)}


def peak_rss_mb(ru: resource.struct_rusage) -> float:
    """This process's peak resident memory: Linux's VmHWM, which starts afresh at exec.
    `ru_maxrss` does not: it keeps the peak of the process that forked this one, so a rank
    started by a 2 GB benchmark reported 2 GB before it had read anything."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return ru.ru_maxrss / 1024
