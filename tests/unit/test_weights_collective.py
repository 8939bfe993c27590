"""The collective weight channel over gloo between real processes: versions arrive bit-equal
(checked against the manifest), and a receiver SIGKILLed or stopped mid-broadcast delays the
sender by at most the timeout, after which the channel is closed and stays closed."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from astraflow.weights.collective import Receiver, Sender, broadcast, open_group
from astraflow.weights.publisher import Publisher
from astraflow.weights.tensors import xxh3

TIMEOUT_S = 3.0


def receiver(store: str, rank: int, world: int, out, fail: str) -> None:
    """A worker's end in its own process: report each version's checksums, or die/stop on the
    first bucket after the header (`fail`)."""
    group = open_group(store, rank, world, TIMEOUT_S)
    rx = Receiver(group, TIMEOUT_S, bucket_mb=0.25)
    try:
        while True:
            if fail:
                header = torch.zeros(3, dtype=torch.int64)
                broadcast(group, header, rx.timeout)
                broadcast(group, torch.empty(int(header[1]), dtype=torch.uint8), rx.timeout)
                broadcast(group, torch.empty(rx.bucket, dtype=torch.uint8), rx.timeout)  # the first bucket
                os.kill(os.getpid(), signal.SIGKILL if fail == "kill" else signal.SIGSTOP)
            tensors, manifest, _ = rx.receive()
            out.put((manifest.version, manifest.name, {n: xxh3(t) for n, t in tensors.items()}))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(("failed", type(e).__name__, str(e)[:200]))


def versions(tmp_path, n: int):
    """n published versions of a ~4 MB bf16 model: (tensors as published, manifest)."""
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(1000, 1024, generator=g), "norm.weight": torch.ones(1024),
             "odd.bias": torch.randn(7, generator=g)}  # an odd size: the next offset is padded
    pub = Publisher(tmp_path / "w", "policy", tmp_path, torch.bfloat16, full_every=100)
    for v in range(1, n + 1):
        for t in state.values():
            t.add_(torch.randn(t.shape, generator=g) * 1e-2)
        p = pub.publish(state, v)
        yield pub.last, p.manifest


def start(tmp_path, fails: list[str]):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=receiver, args=(store, r + 1, len(fails) + 1, out, f), daemon=True)
             for r, f in enumerate(fails)]
    for p in procs:
        p.start()
    return Sender(open_group(store, 0, len(fails) + 1, 60), TIMEOUT_S, bucket_mb=0.25), procs, out


def test_versions_arrive_bit_equal_at_every_receiver(tmp_path):
    sender, procs, out = start(tmp_path, ["", ""])
    try:
        sent = []
        for tensors, manifest in versions(tmp_path, 3):
            assert sender.send(tensors, manifest)
            sent.append((manifest.version, manifest.name, {n: info.xxh3 for n, info in manifest.tensors.items()}))
        got = [out.get(timeout=30) for _ in range(2 * len(sent))]
        assert sorted(got, key=lambda g: g[0]) == sorted(sent * 2, key=lambda s: s[0])
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("fail", ["kill", "stop"])
def test_a_receiver_dying_mid_broadcast_delays_the_sender_at_most_the_timeout(tmp_path, fail):
    sender, procs, out = start(tmp_path, ["", fail])
    try:
        (tensors, manifest), = list(versions(tmp_path, 1))
        t0 = time.monotonic()
        assert not sender.send(tensors, manifest)
        assert time.monotonic() - t0 < TIMEOUT_S + 2.0
        assert not sender.open
        t0 = time.monotonic()
        assert not sender.send(tensors, manifest) and time.monotonic() - t0 < 0.1  # closed: no second wait
        failed = out.get(timeout=TIMEOUT_S + 10)  # the healthy receiver gives up too, and says so
        assert failed[0] == "failed", failed
    finally:
        for p in procs:
            p.kill()
