"""`astraflow bench fuzz`: hostile traffic against a live dataflow rank, while a correct client works.

Fuzzer processes (nice 10, like load generators on other nodes) send, from a seeded RNG:
garbage frames; valid messages with a wrong signature; signed envelopes whose body is random
msgpack or a wrong type for a real message kind; signed envelopes of unknown kinds; signed
valid bodies with bytes flipped, inserted or cut; exact replays of earlier signed frames;
and now and then a frame over the size limit. Some fuzzers hold the run secret — an insider
sending nonsense reaches every decoder — and some do not. Flooders (`flooders`, 0 by
default) send nothing but frames just under the size limit (`max_message_mb`, 1 by default:
the tester's case is 64, with 60 MB frames) with a wrong signature, as fast as the rank takes
them: what they cost the rank before it can refuse them is what the correct client waits.

Meanwhile one correct client registers, leases, commits and asks for status; every call must
succeed, and its latency percentiles are reported. At the end a client with a wrong secret
asks for status and must get nothing. Reported: messages sent per second, messages the rank
handled or refused per second (from its counters), the correct client's p50/p99, the
rank's peak RSS. A rank that died fails the bench with the end of its log.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

from astraflow.bench.payload import random_trajectory
from astraflow.config.rundir import RunDir
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, wait_rendezvous
from astraflow.protocol.codec import Codec
from astraflow.protocol.wire import encode

CONFIG = """
run: {{name: bench-fuzz, seed: 0}}
dataflow: {{interface: loopback, lease_s: 30, heartbeat_timeout_s: 30, max_message_mb: {max_mb}}}
tasks: {{kind: arithmetic, group_size: 4, heldout: 0, max_operand: 40}}
policies:
  - {{name: policy, max_staleness: 1000000, buffer_capacity: 1000000, filter_zero_advantage: false}}
"""
NEAR_LIMIT = 0.94  # a flooder's frames: this fraction of the size limit (60 MB of 64)
MUTATIONS = ("garbage", "bad_signature", "random_body", "unknown_kind", "mutated", "replay", "huge")
WEIGHTS = (20, 10, 20, 10, 30, 10, 0.05)


def _random_value(rng: random.Random, depth: int = 0):
    choice = rng.randrange(8 if depth < 3 else 5)
    if choice == 0:
        return rng.randint(-(1 << 63), (1 << 63) - 1)
    if choice == 1:
        return rng.random() * 10 ** rng.randint(-5, 30)
    if choice == 2:
        return rng.randbytes(rng.randrange(64))
    if choice == 3:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(16)))
    if choice == 4:
        return rng.choice([None, True, False, -1, 0])
    if choice == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    keys = ["n", "worker_id", "task_id", "trajectories", "policy", "step", "versions", "policies", "x"]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(6))}


def _templates(rng: random.Random) -> list:
    """Valid requests of kinds that a mutation may touch without corrupting a run's lineage."""
    nprng = np.random.default_rng(rng.randrange(1 << 30))
    batch = m.TrajectoryBatch.from_trajectories([random_trajectory(nprng, "policy", 12, prompt_tokens=3)] * 4)
    return [m.Heartbeat("fuzz-w"), m.Lease("fuzz-w", 2), m.Status(), m.Weights("policy"), m.Renew("fuzz-w", [1]),
            m.Register(m.PROTOCOL_VERSION, "fuzz-w", ["policy"], 4), m.Commit("fuzz-w", 0, batch),
            m.Release("fuzz-w", [0])]


def _fuzzer(address: str, secret: bytes | None, seed: int, seconds: float, limit: int, max_bytes: int,
            out: mp.Queue) -> None:
    os.nice(10)
    rng = random.Random(seed)
    key = secret or os.urandom(32)  # without the secret, every signature is wrong
    codec = Codec(key)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.connect(address)
    templates = _templates(rng)
    sent: dict[str, int] = dict.fromkeys(MUTATIONS, 0)
    history: list[list[bytes]] = []
    client_id, seq = os.urandom(16), 0
    deadline = time.monotonic() + seconds
    total = 0
    while time.monotonic() < deadline and total < limit:
        kind = rng.choices(MUTATIONS, WEIGHTS)[0]
        seq += 1
        if kind == "garbage":
            frames = [rng.randbytes(rng.randrange(2048)) for _ in range(rng.randrange(5))] or [b""]
        elif kind == "bad_signature":
            frames = codec.pack(rng.choice(templates), client_id, seq)
            frames[1] = rng.randbytes(32)
        elif kind in ("random_body", "unknown_kind"):
            name = rng.choice(list(m.REQUESTS)) if kind == "random_body" else rng.randbytes(6).hex()
            body = _random_value(rng) if kind == "random_body" else {}
            frames = codec.seal(name, client_id, seq, time.time(), msgpack.packb(body, use_bin_type=True))
        elif kind == "mutated":  # a signed body with bytes changed before signing: it reaches the decoders
            template = rng.choice(templates)
            payload = bytearray(msgpack.packb(encode(template), use_bin_type=True))
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(payload) + 1)
                op = rng.randrange(3) if at < len(payload) else 1  # at the end (or into nothing): insert
                if op == 0:
                    payload[at] = rng.randrange(256)
                elif op == 1:
                    payload[at:at] = rng.randbytes(rng.randint(1, 8))
                else:
                    del payload[at:at + rng.randint(1, 8)]
            frames = codec.seal(type(template).__name__.lower(), client_id, seq, time.time(), bytes(payload))
        elif kind == "replay" and history:
            frames = rng.choice(history)
        elif kind == "huge":
            frames = [rng.randbytes(max_bytes + 1024), b"x" * 32]
        else:
            frames = codec.pack(rng.choice(templates), client_id, seq)
        if len(history) < 256 and len(frames) == 3:  # the signed ones (header, mac, body)
            history.append(frames)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.001)
            continue
        sent[kind] += 1
        total += 1
        while sock.poll(0):
            sock.recv_multipart()
    out.put({"sent": sent, "total": total})
    sock.close(0)


def _flooder(address: str, max_message_bytes: int, seconds: float, out: mp.Queue) -> None:
    """Frames just under the size limit with a wrong signature, as fast as the rank takes them."""
    os.nice(10)
    codec = Codec(os.urandom(32))  # not the run secret
    frames = codec.pack(m.Status(), os.urandom(16), 1)
    frames[2] = os.urandom(int(NEAR_LIMIT * max_message_bytes))  # the body
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 2)  # blocks when the rank has not taken the last ones yet
    sock.connect(address)
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sock.poll(100, zmq.POLLOUT):
            sock.send_multipart(frames, copy=False)
            sent += 1
    out.put({"flooded": sent, "flood_mb": sent * len(frames[2]) / 1e6})
    sock.close(0)


def _correct_client(run_dir: str, stop: "mp.Event", out: mp.Queue) -> None:
    run = RunDir.open(run_dir)
    client = Client(wait_rendezvous(run.path)["address"], run.read_secret(), timeout_s=10)
    rng = np.random.default_rng(0)
    latencies: list[float] = []
    failures: list[str] = []
    committed = 0

    def timed(request):
        t0 = time.perf_counter()
        try:
            return client.call(request)
        except Exception as e:  # noqa: BLE001 - every failure is a finding, counted and reported
            failures.append(f"{type(request).__name__}: {e}")
            return None
        finally:
            latencies.append(time.perf_counter() - t0)

    worker = timed(m.Register(m.PROTOCOL_VERSION, "correct", ["policy"], 4)).worker_id
    while not stop.is_set():
        timed(m.Heartbeat(worker))
        reply = timed(m.Lease(worker, 1))
        for task in reply.tasks if reply else []:
            batch = m.TrajectoryBatch.from_trajectories(
                [random_trajectory(rng, "policy", 16, prompt_tokens=4, group_id=task.task_id) for _ in range(4)])
            if (ack := timed(m.Commit(worker, task.task_id, batch))) is not None and ack.status == "stored":
                committed += 1
        timed(m.Status())
        time.sleep(0.01)
    client.close()
    out.put({"latencies": latencies, "failures": failures, "committed": committed})


def _unauthenticated_gets_nothing(address: str) -> bool:
    intruder = Client(address, os.urandom(32), timeout_s=2)
    try:
        intruder.call(m.Status())
        return False
    except TimeoutError:
        return True
    finally:
        intruder.close()


def run_bench(seconds: float = 60.0, max_messages: int = 10**9, fuzzers: int = 2, seed: int | None = None,
              flooders: int = 0, max_message_mb: float = 1.0) -> dict:
    seed = random.randrange(1 << 30) if seed is None else seed
    print(f"bench fuzz: seed {seed}", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="astraflow-fuzz-"))
    (tmp / "fuzz.yaml").write_text(CONFIG.format(max_mb=max_message_mb))
    run = RunDir.create(tmp / "run", tmp / "fuzz.yaml")
    log = open(run.path / "logs" / "dataflow.log", "w")
    rank = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "dataflow", "--run-dir", str(run.path)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        address = wait_rendezvous(run.path, timeout_s=60)["address"]
        status = Client(address, run.read_secret(), timeout_s=30)
        before = sum(status.call(m.Status()).status["protocol"]["counters"].values())
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        limit = int(max_message_mb * (1 << 20))
        max_bytes = 2 * limit  # the socket's own limit (ZMQ_MAXMSGSIZE): "huge" frames go beyond it
        secrets = [run.read_secret() if i % 2 == 0 else None for i in range(fuzzers)]
        stop = ctx.Event()  # the correct client works until the fuzzers are done
        procs = [ctx.Process(target=_fuzzer, args=(address, secrets[i], seed + i, seconds, max_messages // fuzzers,
                                                   max_bytes, out)) for i in range(fuzzers)]
        procs += [ctx.Process(target=_flooder, args=(address, limit, seconds, out)) for _ in range(flooders)]
        procs.append(ctx.Process(target=_correct_client, args=(str(run.path), stop, out)))
        t0 = time.time()
        for p in procs:
            p.start()
        results = [out.get(timeout=seconds + 120) for _ in range(fuzzers + flooders)]
        time.sleep(max(0.0, t0 + seconds - time.time()))  # with no fuzzer at all: the quiet baseline
        wall = time.time() - t0
        stop.set()
        results.append(out.get(timeout=60))
        for p in procs:
            p.join(timeout=30)
        if rank.poll() is not None:  # say why, from the rank's own log, instead of timing out on the status below
            log.flush()
            tail = (run.path / "logs" / "dataflow.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"bench fuzz (seed {seed}): the dataflow rank exited with {rank.returncode}; "
                               f"its log ends:\n{tail}")
        final = status.call(m.Status()).status
        handled = sum(final["protocol"]["counters"].values()) - before
        unauthenticated_silent = _unauthenticated_gets_nothing(address)
        status.close()
    finally:
        rank.send_signal(signal.SIGTERM)
        rank.wait(timeout=60)
        log.close()
    correct = next(r for r in results if "latencies" in r)
    fuzz = [r for r in results if "sent" in r]
    flood = [r for r in results if "flooded" in r]
    lat = np.asarray(correct["latencies"])
    sent = {k: sum(r["sent"][k] for r in fuzz) for k in MUTATIONS}
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "seed": seed, "seconds": wall, "fuzzers": fuzzers, "messages_sent": sum(sent.values()), "sent": sent,
        "sent_per_s": sum(sent.values()) / wall,
        "flooders": flooders, "max_message_mb": max_message_mb,
        "near_limit_frames": sum(r["flooded"] for r in flood), "near_limit_mb": sum(r["flood_mb"] for r in flood),
        "handled_or_refused_per_s": handled / wall,
        "correct_client": {"calls": int(len(lat)), "failures": correct["failures"][:10],
                           "n_failures": len(correct["failures"]), "commits": correct["committed"],
                           "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                           "max_ms": float(lat.max() * 1e3)},
        "unauthenticated_client_got_nothing": unauthenticated_silent,
        "rank_counters": {k: v for k, v in final["protocol"]["counters"].items() if k.startswith(("rejected", "error"))},
        "dataflow_peak_rss_mb": final["process"]["peak_rss_mb"],
    }
