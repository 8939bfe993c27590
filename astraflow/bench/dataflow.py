"""`astraflow bench dataflow`: how many trajectories/s the dataflow rank stores, serves and
verifies, over the real protocol, with a real HDF5 store.

Set-up: a dataflow rank process; N worker processes, each driving C lightweight clients
(one DEALER socket each, all polled by one thread) that lease a task and commit a group of 8
random, incompressible trajectories of T tokens, one commit per group; one consumer process
that pulls batches like a trainer, checks the CRC32 of every trajectory it is served against
the one computed by its sender, and acknowledges each step. Durable means acknowledged after
the HDF5 flush (a SIGKILL of the dataflow rank keeps every acknowledged record; the
integration tests kill it to prove that).

The same run also measures the ceilings of the pieces, for context: raw HDF5 append
bandwidth, msgpack encode/decode and HMAC-SHA256 throughput on a commit-sized message.

A run lists its `problems` (and the CLI exits 1): serving that fell behind storing
(`served_vs_committed` under `SERVED_FLOOR`), samples the rank counted as unused, checksum
failures, acknowledged trajectories not stored. Its throughput is then not the rank's.
"""
from __future__ import annotations

import hashlib
import hmac
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import msgpack
import numpy as np
import zmq

from astraflow.bench.payload import PayloadPool, payload_crc, random_trajectory
from astraflow.config.rundir import RunDir
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, wait_rendezvous
from astraflow.protocol.codec import RemoteError
from astraflow.protocol.wire import encode
from astraflow.store.writer import RowBatch, ShardWriter, StoreOptions

GROUP = 8
BATCH = 256
PREFETCH = 2
# Served and verified over acknowledged below this is a problem of the run (`problems`): the
# consumer runs a second past the workers to catch up, so a rank that keeps up serves ~1.
SERVED_FLOOR = 0.9
BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 1  # tokens, logprobs, loss mask, versions, token policy

# The consumer takes the trainer's part for as long as the bench runs: its planned steps must
# outlast any run (a run of the default 50 steps had the rank count every later sample as a
# finished trainer's, unused, and the consumer waited out the clock: 12,800 served, whatever
# the duration).
TRAINER_STEPS = 1 << 30

CONFIG = """
run: {{name: bench-dataflow, seed: 0}}
dataflow: {{interface: loopback, lease_s: 120, heartbeat_timeout_s: 120}}
store: {{compression: {compression}, shard_max_mb: 2048, fsync: {fsync}}}
tasks: {{kind: arithmetic, group_size: {group}, heldout: 0, max_operand: 40}}
trainer: {{steps: {steps}, batch_size: {batch}}}
policies:
  - {{name: policy, max_staleness: 1000000, buffer_capacity: {capacity}, filter_zero_advantage: false}}
"""


def bench_config(compression: str = "none", fsync: str = "true") -> str:
    """The bench run's config.yaml."""
    return CONFIG.format(compression=compression, fsync=fsync, group=GROUP, capacity=1 << 20, steps=TRAINER_STEPS,
                         batch=BATCH)


# The load generators run at a lower priority than the dataflow rank they load, as they
# would on their own nodes: on a 2-core box, fair scheduling would otherwise stall the one
# process every request waits for behind eight that only wait for it.
WORKER_NICE = 10
LEASE_AHEAD = 4  # tasks a client leases at once, as a real worker with spare capacity does


def _worker(run_dir: str, index: int, clients: int, tokens: int, seconds: float, go: "mp.Barrier",
            out: mp.Queue) -> None:
    os.nice(WORKER_NICE)
    secret = RunDir.open(run_dir).read_secret()
    address = wait_rendezvous(run_dir)["address"]
    ctx = zmq.Context()
    pool = PayloadPool(np.random.default_rng(index), "policy", tokens)
    conns = [Client(address, secret, context=ctx) for _ in range(clients)]
    poller = zmq.Poller()
    ids = []
    for i, c in enumerate(conns):
        register = m.Register(m.PROTOCOL_VERSION, f"bench-{index}-{i}", ["policy"], capacity=LEASE_AHEAD)
        ids.append(c.call(register).worker_id)
        poller.register(c.sock, zmq.POLLIN)
    by_sock = {c.sock: i for i, c in enumerate(conns)}
    pending: dict[int, tuple[str, int, float]] = {}  # client -> (kind, seq, t_sent)
    in_hand: list[list[int]] = [[] for _ in conns]  # leased task ids per client
    latencies: list[float] = []
    committed = 0

    def next_request(i: int) -> None:
        if in_hand[i]:
            tid = in_hand[i].pop()
            trajs = m.TrajectoryBatch.from_trajectories([pool.draw(tid) for _ in range(GROUP)])
            pending[i] = ("commit", conns[i].send(m.Commit(ids[i], tid, trajs)), time.perf_counter())
        else:
            pending[i] = ("lease", conns[i].send(m.Lease(ids[i], LEASE_AHEAD)), time.perf_counter())

    go.wait()
    cpu0 = sum(os.times()[:2])
    deadline = time.time() + seconds
    for i in range(clients):
        next_request(i)
    while time.time() < deadline:
        for sock, _ in poller.poll(100):
            i = by_sock[sock]
            kind, seq, t0 = pending[i]
            reply = conns[i].poll(seq, 0)
            if reply is None:
                continue
            if kind == "commit":
                latencies.append(time.perf_counter() - t0)
                committed += len(reply.sample_ids)
            else:
                in_hand[i] = [t.task_id for t in reply.tasks]
                if not reply.tasks:
                    time.sleep(0.01)
            next_request(i)
    out.put({"committed": committed, "latencies": latencies, "cpu_s": sum(os.times()[:2]) - cpu0})


def _consumer(run_dir: str, seconds: float, go: "mp.Barrier", out: mp.Queue) -> None:
    secret = RunDir.open(run_dir).read_secret()
    c = Client(wait_rendezvous(run_dir)["address"], secret, timeout_s=5.0)
    c.call(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    go.wait()
    cpu0 = sum(os.times()[:2])
    deadline = time.time() + seconds + 1.0  # a little longer: serve what was committed at the end
    verified, bad, seen = 0, 0, set()
    longest_wait, waiting_since = 0.0, time.time()
    # Like a trainer that prefetches: batches for the next PREFETCH steps are requested before
    # this one is checked, and acknowledgements are not waited for one by one.
    inflight = deque((s, c.send(m.Batch("policy", s, BATCH))) for s in range(1, PREFETCH + 1))
    step, stopped, acks = 0, "deadline", []
    while time.time() < deadline:
        step, seq = inflight.popleft()
        try:
            batch = c.poll(seq, max(0.1, deadline - time.time()))
        except RemoteError as e:
            stopped = str(e)
            break
        if batch is None:
            break
        longest_wait, waiting_since = max(longest_wait, time.time() - waiting_since), time.time()
        sample_ids = batch.sample_ids.tolist()
        acks.append(c.send(m.Consumed("policy", step, sample_ids)))
        inflight.append((step + PREFETCH, c.send(m.Batch("policy", step + PREFETCH, BATCH))))
        trajs, off = batch.trajectories, batch.trajectories.offsets
        for i, sid in enumerate(sample_ids):
            lo, hi = off[i], off[i + 1]
            ok = payload_crc(trajs.tokens[lo:hi], trajs.logprobs[lo:hi]) == trajs.meta[i]["crc"] and sid not in seen
            seen.add(sid)
            verified += ok
            bad += not ok
    for seq in acks:  # every acknowledgement must have been accepted
        try:
            c.poll(seq, 5.0)
        except RemoteError as e:
            stopped = f"consumed refused: {e}"
    longest_wait = max(longest_wait, min(time.time(), deadline) - waiting_since)  # a wait the clock cut short
    out.put({"verified": verified, "bad": bad, "steps": step, "stopped": stopped, "longest_wait_s": longest_wait,
             "cpu_s": sum(os.times()[:2]) - cpu0})


def _ceilings(tokens: int, tmp: Path) -> dict[str, float]:
    rng = np.random.default_rng(0)
    trajs = m.TrajectoryBatch.from_trajectories([random_trajectory(rng, "policy", tokens) for _ in range(GROUP)])
    commit = m.Commit("w", 0, trajs)
    body = msgpack.packb(encode(commit), use_bin_type=True)
    mb = len(body) / 1e6
    reps = 200
    t = time.perf_counter()
    for _ in range(reps):
        msgpack.packb(encode(commit), use_bin_type=True)
    enc = reps * mb / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(reps):
        msgpack.unpackb(body, raw=False)
    dec = reps * mb / (time.perf_counter() - t)
    key = os.urandom(32)
    t = time.perf_counter()
    for _ in range(reps):
        hmac.digest(key, body, hashlib.sha256)
    mac = reps * mb / (time.perf_counter() - t)
    # Raw HDF5 append: the same flat layout, one flush per group, no protocol around it.
    writer = ShardWriter(tmp / "ceiling.h5", ("policy",), StoreOptions())
    n = GROUP
    batch = RowBatch(
        tokens={c: getattr(trajs, c) for c in m.TOKEN_FIELDS},
        rows={"sample_id": np.arange(n), "task_id": np.zeros(n, np.int64), "episode_id": np.zeros(n, np.int64),
              "group_id": np.zeros(n, np.int64), "policy": np.zeros(n, np.uint8), "worker": np.full(n, b"w", "S64"),
              "length": np.full(n, tokens, np.int32), "reward": np.zeros(n, np.float32),
              "guided": np.zeros(n, np.uint8), "weight": np.ones(n, np.float32), "gen_s": np.zeros(n, np.float32),
              "t_commit": np.zeros(n),
              "version_min": np.zeros(n, np.int32), "version_max": np.zeros(n, np.int32),
              "version_at_commit": np.zeros(n, np.int32)},
        meta=[b""] * n)
    t = time.perf_counter()
    for _ in range(reps):
        writer.stage(batch)
        writer.flush()
    h5 = reps * n * tokens * BYTES_PER_TOKEN / 1e6 / (time.perf_counter() - t)
    writer.close()
    return {"hdf5_append_mb_per_s": h5, "hdf5_append_trajectories_per_s": h5 * 1e6 / (tokens * BYTES_PER_TOKEN),
            "msgpack_encode_mb_per_s": enc, "msgpack_decode_mb_per_s": dec, "hmac_sha256_mb_per_s": mac}


def run_bench(workers: int = 8, clients_per_process: int = 8, seconds: float = 20.0, tokens: int = 1024,
              compression: str = "none", fsync: str = "true", run_dir: str | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="astraflow-bench-"))
    cfg = tmp / "bench.yaml"
    cfg.write_text(bench_config(compression, fsync))
    run = RunDir.create(Path(run_dir) if run_dir else tmp / "run", cfg)
    log = open(run.path / "logs" / "dataflow.log", "w")
    rank = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "dataflow", "--run-dir", str(run.path)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_rendezvous(run.path, timeout_s=60)
        ceilings = _ceilings(tokens, tmp)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        go = ctx.Barrier(workers + 2)  # the clock starts once every process has connected
        procs = [ctx.Process(target=_worker, args=(str(run.path), i, clients_per_process, tokens, seconds, go, out))
                 for i in range(workers)]
        procs.append(ctx.Process(target=_consumer, args=(str(run.path), seconds, go, out)))
        for p in procs:
            p.start()
        status_client = Client(wait_rendezvous(run.path)["address"], run.read_secret())
        go.wait(timeout=120)
        start = time.time()
        before = status_client.call(m.Status()).status["process"]
        results = [out.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        wall = time.time() - start
        status = status_client.call(m.Status()).status
    finally:
        rank.send_signal(signal.SIGTERM)
        rank.wait(timeout=60)
        log.close()
    lat = np.concatenate([np.asarray(r["latencies"]) for r in results if "latencies" in r] or [np.zeros(1)])
    committed = sum(r.get("committed", 0) for r in results)
    consumer = next(r for r in results if "verified" in r)
    elapsed = seconds
    served = consumer["verified"] / max(committed, 1)
    policy = status["policies"]["policy"]
    result = {
        "workers": workers, "clients_per_process": clients_per_process, "tokens": tokens, "group": GROUP,
        "seconds": seconds, "compression": compression, "fsync": fsync,
        "trajectories_committed": committed,
        "trajectories_verified": consumer["verified"], "checksum_failures": consumer["bad"],
        "consumer_steps": consumer["steps"], "consumer_stopped": consumer["stopped"],
        "consumer_longest_wait_s": consumer["longest_wait_s"],
        # served and verified / acknowledged: about 1 while serving keeps up with storing
        "served_vs_committed": served,
        "dataflow_unused": policy["unused"],  # samples stored after the rank took the trainer for finished
        "trajectories_per_s": min(committed, consumer["verified"]) / elapsed,
        "committed_per_s": committed / elapsed,
        "tokens_per_s": min(committed, consumer["verified"]) * tokens / elapsed,
        "mb_per_s": committed * tokens * BYTES_PER_TOKEN / 1e6 / elapsed,
        "p50_commit_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_commit_ms": float(np.percentile(lat, 99) * 1e3),
        "dataflow_stored": policy["stored"],
        # every acknowledged trajectory must be stored (more may be: commits whose ack was not read)
        "acknowledged_not_stored": max(0, committed - policy["stored"]),
        "dataflow_rejected": {k: v for k, v in status["protocol"]["counters"].items() if k.startswith(("rejected", "error"))},
        "ceilings": ceilings,
        "cpu_s": {"dataflow": sum(status["process"][k] - before[k] for k in ("cpu_user_s", "cpu_sys_s")),
                  "workers": sum(r["cpu_s"] for r in results if "latencies" in r),
                  "consumer": consumer["cpu_s"]},
        "dataflow_peak_rss_mb": status["process"]["peak_rss_mb"],
        "wall_s": wall,
    }
    result["problems"] = problems(result)
    if run_dir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def problems(result: dict) -> list[str]:
    """What makes a run's figures wrong, one line each (the CLI exits 1 on any): serving that
    fell behind storing is the rank's limit, not a number to report as throughput."""
    out = []
    if result["served_vs_committed"] < SERVED_FLOOR:
        out.append(f"served and verified {result['trajectories_verified']:,} of {result['trajectories_committed']:,} "
                   f"acknowledged ({result['served_vs_committed']:.2f} < {SERVED_FLOOR}): serving fell behind "
                   f"storing (the consumer waited up to {result['consumer_longest_wait_s']:.1f}s for a batch)")
    if result["dataflow_unused"]:
        out.append(f"{result['dataflow_unused']:,} stored samples counted as unused: the rank took the consumer "
                   f"for a finished trainer")
    if result["checksum_failures"] or result["acknowledged_not_stored"]:
        out.append(f"{result['checksum_failures']} checksum failures, {result['acknowledged_not_stored']} "
                   f"acknowledged trajectories not stored")
    return out
