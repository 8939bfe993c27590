"""`astraflow bench scale`: the dataflow rank under a thousand workers, over millions stored.

Set-up: a run directory whose shards already hold `stored` short trajectories, written through
the real shard writer and all acknowledged by a trainer (`bench restart`'s `populate`); a
dataflow rank process on it (its start is timed: recovery); `clients` simulated rollout
workers over the real protocol, spread over `processes` processes. A simulated worker is a
real worker's message pattern without a model: Register; Lease for its free slots
(`concurrency` episodes at once; a real worker runs `rollout.concurrency`, 16 by default);
each leased task "generates" for an exponential time of mean `gen_s`, then is committed as
a group of `GROUP` trajectories of `tokens` tokens; keep-alive exactly as the real worker
(`rollout/keepalive.py`: a Renew for leases half their term old, a Heartbeat only after a
silent interval); a Weights poll only after `rollout.weight_poll_s` without a reply naming
the versions; an empty lease waits what the reply says, with the worker's backoff.
One consumer takes a trainer's part: it asks for the next step's batch as soon as the last
one is acknowledged.

After `seconds` the workers stop and wait for their last replies, the rank is SIGKILLed and
started again on the same directory: that restart is timed, and what it recovered is compared
with what was acknowledged (every acknowledged commit stored once: no lost, no duplicate).

Reported: latency p50/p99 by message kind (register, lease, commit, renew, heartbeat,
weights, and the consumer's batch), messages/s, the share of messages that carried no work
(heartbeats, Weights polls, leases answered with no task) and of keep-alive messages
(heartbeats and renewals), the rank's peak RSS, the two start times, and `targets` (for
1,024 workers and 10 M stored on a 2-core machine: commit p99 <= 250 ms, no work <= 5% of
messages, RSS <= 1 GB, restart <= 60 s) with whether each was met. `problems` lists lost or
duplicated commits and requests left unanswered (the CLI exits 1 on any).
"""
from __future__ import annotations

import heapq
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from astraflow.bench.payload import PayloadPool
from astraflow.bench.restart import BATCH, populate
from astraflow.config.rundir import RunDir
from astraflow.protocol import messages as m
from astraflow.protocol.backoff import Backoff
from astraflow.protocol.client import Client, wait_rendezvous
from astraflow.rollout.keepalive import is_contact, keepalive_due
from astraflow.rollout.worker import OPEN_ENDED

GROUP = 8
CONCURRENCY = 2  # episodes a simulated worker runs at once, by default: a small worker's, the most
# keep-alive messages per unit of work (heartbeats go per worker, work per episode)
WORKER_NICE = 10  # the load generators yield to the rank they load (as `bench dataflow`)
TARGETS = {"commit_p99_ms": 250.0, "no_work_fraction": 0.05, "dataflow_peak_rss_mb": 1024.0,
           "restart_after_kill_s": 60.0}

CONFIG = """
run: {{name: bench-scale, seed: 0}}
dataflow: {{interface: loopback, heartbeat_timeout_s: {heartbeat_timeout_s}, lease_s: {lease_s}}}
store: {{shard_max_mb: 1024}}
tasks: {{kind: arithmetic, group_size: {group}, heldout: 0, max_operand: 40}}
trainer: {{steps: {steps}, batch_size: {batch}}}
policies:
  - {{name: policy, max_staleness: 1000000, buffer_capacity: {capacity}, filter_zero_advantage: false}}
"""


@dataclass
class SimWorker:
    conn: Client
    worker_id: str
    every: float  # keep-alive interval (the rank's heartbeat interval)
    lease_s: float
    last_contact: float
    next_keepalive: float
    last_latest: float
    lease_after: float = 0.0
    done_at: dict[int, float] = field(default_factory=dict)  # task -> when its generation ends
    leased_at: dict[int, float] = field(default_factory=dict)  # task -> lease granted or renewed
    backoff: Backoff = field(default_factory=Backoff)
    pending: tuple | None = None  # (kind, seq, t_sent, request)


class Load:
    """One process's simulated workers, driven by one poll loop and a heap of wake-up times."""

    def __init__(self, run_dir: str, index: int, clients: int, tokens: int, gen_s: float, poll_s: float,
                 concurrency: int) -> None:
        self.secret = RunDir.open(run_dir).read_secret()
        self.address = wait_rendezvous(run_dir)["address"]
        self.ctx = zmq.Context()
        self.rng = np.random.default_rng(index)
        self.pool = PayloadPool(self.rng, "policy", tokens)
        self.gen_s, self.poll_s, self.concurrency = gen_s, poll_s, concurrency
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.acked: list[int] = []
        self.sims: list[SimWorker] = []
        now = time.monotonic()
        for i in range(clients):
            conn = Client(self.address, self.secret, context=self.ctx)
            t0 = time.perf_counter()
            reply = conn.call(m.Register(m.PROTOCOL_VERSION, f"sim-{index}-{i}", ["policy"], capacity=concurrency))
            self._count("register", time.perf_counter() - t0)
            every = min(reply.heartbeat_s, reply.lease_s / 3)
            self.sims.append(SimWorker(conn, reply.worker_id, every, reply.lease_s, now, now + every, now))

    def _count(self, kind: str, latency: float) -> None:
        self.latencies[kind].append(latency)
        self.counts[kind] += 1

    def _next(self, s: SimWorker, now: float) -> tuple[str, object] | float:
        """The request `s` sends now, or when it next has one to send."""
        if now >= s.next_keepalive:
            s.next_keepalive += s.every
            heartbeat, renew = keepalive_due(now, s.last_contact, s.leased_at, s.every, s.lease_s / 2)
            if renew:
                return "renew", m.Renew(s.worker_id, renew)
            if heartbeat:
                return "heartbeat", m.Heartbeat(s.worker_id, {"policy": 0})
        finished = [t for t, at in s.done_at.items() if at <= now]
        if finished:
            tid = finished[0]
            trajs = m.TrajectoryBatch.from_trajectories([self.pool.draw(tid) for _ in range(GROUP)])
            return "commit", m.Commit(s.worker_id, tid, trajs, {"policy": 0})
        if now - s.last_latest >= self.poll_s:
            s.last_latest = now  # asked: the reply names the versions
            return "weights", m.Weights("policy")
        free = self.concurrency - len(s.done_at)
        if free > 0 and now >= s.lease_after:
            return "lease", m.Lease(s.worker_id, free, {"policy": 0})
        wakes = [s.next_keepalive, s.last_latest + self.poll_s, *s.done_at.values()]
        if free > 0:
            wakes.append(s.lease_after)
        return min(wakes)

    def _answered(self, s: SimWorker, kind: str, request: Any, reply: Any, now: float) -> None:
        if is_contact(request):
            s.last_contact = now
        if getattr(reply, "latest", None):
            s.last_latest = now
        if kind == "lease":
            for task in reply.tasks:
                s.leased_at[task.task_id] = now
                s.done_at[task.task_id] = now + self.rng.exponential(self.gen_s)
            if reply.tasks:
                s.backoff.reset()
            else:
                self.counts["lease_empty"] += 1
                wait = s.backoff.delay(reply.retry_after_s) if reply.reason in OPEN_ENDED \
                    else max(0.02, reply.retry_after_s)
                s.lease_after = now + wait
        elif kind == "commit":
            s.done_at.pop(request.task_id)
            s.leased_at.pop(request.task_id, None)
            self.acked.extend(reply.sample_ids)
        elif kind == "renew":
            s.leased_at.update(dict.fromkeys(reply.renewed, now))
            for task_id in reply.lost:
                s.leased_at.pop(task_id, None)

    def run(self, seconds: float, drain_s: float = 30.0) -> None:
        poller = zmq.Poller()
        by_sock = {}
        wake: list[tuple[float, int]] = [(0.0, i) for i in range(len(self.sims))]
        for i, s in enumerate(self.sims):
            poller.register(s.conn.sock, zmq.POLLIN)
            by_sock[s.conn.sock] = i
        deadline = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            stopping = now >= deadline
            if stopping and not any(s.pending for s in self.sims):
                return
            if stopping and now >= deadline + drain_s:
                raise TimeoutError(f"{sum(bool(s.pending) for s in self.sims)} requests unanswered {drain_s}s after "
                                   "the end")
            while wake and wake[0][0] <= now and not stopping:
                _, i = heapq.heappop(wake)
                s = self.sims[i]
                nxt = self._next(s, now)
                if isinstance(nxt, float):
                    heapq.heappush(wake, (nxt, i))
                else:
                    kind, request = nxt
                    s.pending = (kind, s.conn.send(request), time.perf_counter(), request)
            timeout_ms = 100 if stopping or not wake else max(0, min(100, int((wake[0][0] - now) * 1000) + 1))
            for sock, _ in poller.poll(timeout_ms):
                i = by_sock[sock]
                s = self.sims[i]
                kind, seq, t0, request = s.pending
                reply = s.conn.poll(seq, 0)
                if reply is None:
                    continue
                self._count(kind, time.perf_counter() - t0)
                s.pending = None
                self._answered(s, kind, request, reply, time.monotonic())
                heapq.heappush(wake, (time.monotonic(), i))


def _load(run_dir: str, index: int, clients: int, tokens: int, gen_s: float, poll_s: float, concurrency: int,
          seconds: float, go: "mp.Barrier", out: mp.Queue) -> None:
    os.nice(WORKER_NICE)
    load = None
    try:
        load = Load(run_dir, index, clients, tokens, gen_s, poll_s, concurrency)
        go.wait()
        load.run(seconds)
        error = ""
    except Exception as e:  # reported, not hung on: the commits acknowledged so far still count
        go.abort()  # a load that never started must not leave the others waiting at the barrier
        error = f"load process {index}: {type(e).__name__}: {e}"
    out.put({"latencies": dict(load.latencies) if load else {}, "counts": dict(load.counts) if load else {},
             "acked": load.acked if load else [], "error": error})


def _consumer(run_dir: str, resume_step: int, seconds: float, go: "mp.Barrier", out: mp.Queue) -> None:
    """A trainer: the next step's batch as soon as the last is acknowledged."""
    c = Client(wait_rendezvous(run_dir)["address"], RunDir.open(run_dir).read_secret(), timeout_s=30.0)
    c.call(m.Ready(m.PROTOCOL_VERSION, "policy", resume_step))
    go.wait()
    latencies, served, deadline, step = [], [], time.monotonic() + seconds, resume_step
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        seq = c.send(m.Batch("policy", step + 1, BATCH))
        batch = c.poll(seq, max(0.1, deadline - time.monotonic()))
        if batch is None:
            break
        step += 1
        latencies.append(time.perf_counter() - t0)
        ids = batch.sample_ids.tolist()
        served.extend(ids)
        c.call(m.Consumed("policy", step, ids))
    out.put({"batch": latencies, "served": served, "steps": step - resume_step})


def _start_rank(run: RunDir, log_name: str) -> tuple[subprocess.Popen, float, dict]:
    """A dataflow rank on `run`; seconds until it answers Status, and that status."""
    log = open(run.path / "logs" / log_name, "w")
    t0, started = time.perf_counter(), time.time()
    rank = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "dataflow", "--run-dir", str(run.path)],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    address = wait_rendezvous(run.path, timeout_s=3600, newer_than=started)["address"]
    status = Client(address, run.read_secret(), timeout_s=600).call(m.Status()).status
    return rank, time.perf_counter() - t0, status


def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs) * 1e3
    return {"n": len(a), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


def run_bench(clients: int = 1024, stored: int = 1_000_000, seconds: float = 60.0, processes: int = 4,
              tokens: int = 64, gen_s: float = 4.0, poll_s: float = 30.0, heartbeat_timeout_s: float = 30.0,
              lease_s: float = 60.0, concurrency: int = CONCURRENCY) -> dict:
    """Run the bench in a temporary directory, removed at the end with every process it
    started, whatever happens."""
    tmp = Path(tempfile.mkdtemp(prefix="astraflow-scale-"))
    started: list = []  # the load and consumer processes, the ranks
    try:
        return _measure(tmp, started, clients, stored, seconds, processes, tokens, gen_s, poll_s,
                        heartbeat_timeout_s, lease_s, concurrency)
    finally:
        for p in started:
            if isinstance(p, subprocess.Popen):
                p.kill()
                p.wait()
            elif p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(tmp: Path, started: list, clients: int, stored: int, seconds: float, processes: int, tokens: int,
             gen_s: float, poll_s: float, heartbeat_timeout_s: float, lease_s: float, concurrency: int) -> dict:
    (tmp / "scale.yaml").write_text(CONFIG.format(group=GROUP, steps=1 << 30, batch=BATCH, capacity=1 << 30,
                                                  heartbeat_timeout_s=heartbeat_timeout_s, lease_s=lease_s))
    run = RunDir.create(tmp / "run", tmp / "scale.yaml")
    consumed = stored // BATCH * BATCH
    t0 = time.perf_counter()
    populate(run, stored, consumed, 4)
    populate_s = time.perf_counter() - t0
    rank, start_s, _ = _start_rank(run, "dataflow.log")
    started.append(rank)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = ctx.Barrier(processes + 2)
    share = [clients // processes + (i < clients % processes) for i in range(processes)]
    procs = [ctx.Process(target=_load, args=(str(run.path), i, n, tokens, gen_s, poll_s, concurrency, seconds, go,
                                                     out))
             for i, n in enumerate(share)]
    procs.append(ctx.Process(target=_consumer, args=(str(run.path), consumed // BATCH, seconds, go, out)))
    started.extend(procs)
    for p in procs:
        p.start()
    status_client = Client(wait_rendezvous(run.path)["address"], run.read_secret())
    go.wait(timeout=600)
    before = status_client.call(m.Status()).status["protocol"]["counters"]
    t_load = time.perf_counter()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    load_s = time.perf_counter() - t_load
    for p in procs:
        p.join(timeout=30)
    status = status_client.call(m.Status()).status
    status_client.close()
    rank.send_signal(signal.SIGKILL)
    rank.wait(timeout=60)
    rank, restart_s, after = _start_rank(run, "dataflow-restarted.log")
    started.append(rank)
    rank.send_signal(signal.SIGTERM)
    rank.wait(timeout=120)

    loads = [r for r in results if "acked" in r]
    consumer = next(r for r in results if "served" in r)
    counts: dict[str, int] = defaultdict(int)
    latencies: dict[str, list[float]] = defaultdict(list)
    for r in loads:
        for k, v in r["counts"].items():
            counts[k] += v
        for k, v in r["latencies"].items():
            latencies[k].extend(v)
    latencies["batch"] = consumer["batch"]
    acked = [s for r in loads for s in r["acked"]]
    sent = sum(v for k, v in counts.items() if k != "lease_empty") + 2 * consumer["steps"]  # + Batch, Consumed
    no_work = counts["heartbeat"] + counts["weights"] + counts["lease_empty"]
    recovered = after["policies"]["policy"]["stored"]
    rank_counters = status["protocol"]["counters"]
    result = {
        "clients": clients, "processes": processes, "stored_before": stored, "seconds": seconds, "tokens": tokens,
        "gen_s": gen_s, "concurrency": concurrency, "populate_s": populate_s,
        "start_to_serving_s": start_s,
        "latency": {k: _pct(v) for k, v in sorted(latencies.items())},
        "messages": dict(sorted(counts.items())), "consumer_steps": consumer["steps"],
        "messages_per_s": sent / load_s,
        "dataflow_requests": {k: rank_counters.get(k, 0) - before.get(k, 0) for k in sorted(rank_counters)
                              if rank_counters.get(k, 0) != before.get(k, 0)},
        "no_work_fraction": no_work / max(sent, 1),
        "keepalive_fraction": (counts["heartbeat"] + counts["renew"]) / max(sent, 1),
        "committed_trajectories": len(acked), "committed_per_s": len(acked) / load_s,
        "served_trajectories": len(consumer["served"]),
        "dataflow_peak_rss_mb": status["process"]["peak_rss_mb"],
        "restart_after_kill_s": restart_s,
        "restarted_peak_rss_mb": after["process"]["peak_rss_mb"],
        "recovered_stored": recovered,
        "lost": max(0, stored + len(acked) - recovered), "duplicated": len(acked) - len(set(acked)),
        "served_twice": len(consumer["served"]) - len(set(consumer["served"])),
        "wall_s": time.perf_counter() - t0,
    }
    result["extra_stored"] = max(0, recovered - stored - len(set(acked)))  # commits never acknowledged: none here
    commit_p99 = result["latency"].get("commit", {}).get("p99_ms", float("inf"))
    measured = {"commit_p99_ms": commit_p99, "no_work_fraction": result["no_work_fraction"],
                "dataflow_peak_rss_mb": max(result["dataflow_peak_rss_mb"], result["restarted_peak_rss_mb"]),
                "restart_after_kill_s": restart_s}
    result["targets"] = {k: {"target": TARGETS[k], "measured": v, "met": v <= TARGETS[k]} for k, v in measured.items()}
    result["problems"] = [f"{result[k]:,} {k.replace('_', ' ')}" for k in ("lost", "duplicated", "served_twice",
                                                                           "extra_stored") if result[k]]
    result["problems"] += [r["error"] for r in loads if r["error"]]
    return result
