"""`astraflow bench weights --workers 1 4`: the collective weight channel against the link's
ceiling, in the same run.

For each worker count N, N receiver processes (spawned) and this process (rank 0, the
trainer's end) form one gloo group, as a job's trainer and rollout workers do. Each receiver
holds an hf engine of the model in the publish dtype. Per round:
- raw: rank 0 broadcasts the version's payload bytes as one flat buffer (`torch.distributed`
  with nothing around it: the link's ceiling for these bytes);
- channel: rank 0 sends the version with `weights/collective.Sender` (header, manifest,
  bucketed payload, passed down the chain of receivers or broadcast by rank 0: `--relay`),
  each receiver takes it with `Receiver` (checksums verified) and installs it into its
  engine, as a worker does.
After each, every member's finish time (wall clock: one machine) is gathered at rank 0, so
the seconds reported run from the start of the send to a worker's finish. A round's time is
its slowest worker's; summaries are medians over rounds, p50/p99 of `applied_s` over every
worker of every round. The first `WARMUP` rounds are not counted, as a running job's first
versions are not its steady state: a receiver allocates its two receive buffers in them (a
worker holds one version while the next arrives; a fresh buffer costs the kernel's page
faults, `weights/collective.py`) and the raw buffers are first touched; `first_received_s`
reports the first round's channel time. `efficiency` is raw seconds over channel-received seconds: the share of
the raw bandwidth the channel reaches.

Invariant: the version sent is a full one (the channel sends whole tensors); a receiver
checks every tensor against the manifest's checksum before installing it, so a result here
is a verified delivery, not just bytes moved.
"""
from __future__ import annotations

import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from astraflow.weights.collective import Receiver, Sender, broadcast, layout, open_group
from astraflow.weights.manifest import Manifest

SETUP_S = 600.0  # every receiver builds its engine before the first round
WARMUP = 2  # rounds before the measured ones
TIMEOUT = datetime.timedelta(seconds=600)


def _gather_times(group: dist.ProcessGroup, mine: list[float], world: int) -> list[list[float]]:
    """Every member's `mine` (same length), at every member (gloo all-gather)."""
    inp = torch.tensor(mine, dtype=torch.float64)
    out = [torch.zeros_like(inp) for _ in range(world)]
    group.allgather([out], [inp]).wait(TIMEOUT)
    return [t.tolist() for t in out]


def _receiver(store: str, rank: int, world: int, model_dir: str, dtype: str, rounds: int, total: int,
              bucket_mb: float, relay: str, threads: int) -> None:
    """A worker's end: an engine, then per round the raw bytes and a version through the channel."""
    from astraflow.rollout.engines.hf import HFEngine

    torch.set_num_threads(threads)
    group = open_group(Path(store), rank, world, SETUP_S)
    engine = HFEngine(model_dir, threads=threads, dtype=dtype)
    rx = Receiver(group, TIMEOUT.total_seconds(), bucket_mb, relay)
    raw = torch.empty(total, dtype=torch.uint8)
    _gather_times(group, [time.time(), 0.0], world)  # ready
    for _ in range(WARMUP + rounds):
        broadcast(group, raw, TIMEOUT)
        _gather_times(group, [time.time(), 0.0], world)
        tensors, _, _ = rx.receive()
        received = time.time()
        engine.install(tensors)
        _gather_times(group, [received, time.time()], world)
    engine.close()


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]


def measure_workers(tensors: dict[str, torch.Tensor], manifest: Manifest, model_dir: Path, dtype: str, workers: int,
                    rounds: int, bucket_mb: float, relay: str, threads: int) -> dict:
    """Raw broadcast and channel delivery of one full version to `workers` receivers."""
    _, total = layout(manifest)
    world = workers + 1
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-collective-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_receiver, args=(store, r, world, str(model_dir), dtype, rounds, total, bucket_mb,
                                                     relay, threads), daemon=True) for r in range(1, world)]
        for p in procs:
            p.start()
        try:
            group = open_group(Path(store), 0, world, SETUP_S)
            sender = Sender(group, TIMEOUT.total_seconds(), bucket_mb, relay)
            flat = torch.zeros(total, dtype=torch.uint8)
            _gather_times(group, [time.time(), 0.0], world)
            raw_s, received_s, applied_s, install_s = [], [], [], []
            for _ in range(WARMUP + rounds):
                t0 = time.time()
                broadcast(group, flat, TIMEOUT)
                done = _gather_times(group, [t0, 0.0], world)[1:]
                raw_s.append(max(t for t, _ in done) - t0)
                t0 = time.time()
                if not sender.send(tensors, manifest):
                    raise RuntimeError(f"the collective channel failed sending to {workers} workers")
                done = _gather_times(group, [t0, 0.0], world)[1:]
                received_s.append(max(r for r, _ in done) - t0)
                applied_s += [a - t0 for _, a in done]
                install_s += [a - r for r, a in done]
            first_received_s = received_s[0]
            del raw_s[:WARMUP], received_s[:WARMUP], applied_s[:WARMUP * workers], install_s[:WARMUP * workers]
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
    raw, received = _median(raw_s), _median(received_s)
    return {"workers": workers, "rounds": rounds, "payload_bytes": total, "bucket_mb": bucket_mb, "relay": relay,
            "raw_s": raw, "raw_gbps": total / raw / 1e9, "received_s": received,
            "channel_gbps": total / received / 1e9, "efficiency": raw / received, "first_received_s": first_received_s,
            "applied_p50_s": _median(applied_s), "applied_p99_s": _p99(applied_s),
            "install_s": _median(install_s)}


def measure(tensors: dict[str, torch.Tensor], manifest: Manifest, model_dir: Path, dtype: str,
            worker_counts: list[int], rounds: int, bucket_mb: float, relay: str, threads: int) -> dict:
    """`measure_workers` for each count; `applied_ratio`: p50 applied time at the largest count
    over that at the smallest (the channel's scaling with workers)."""
    rows = [measure_workers(tensors, manifest, model_dir, dtype, n, rounds, bucket_mb, relay, threads)
            for n in worker_counts]
    return {"channel": "collective (gloo)", "per_workers": rows,
            "applied_ratio": rows[-1]["applied_p50_s"] / rows[0]["applied_p50_s"]}
