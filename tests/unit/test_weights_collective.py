"""The collective weight channel over gloo between real processes, with either relay (each
piece broadcast from rank 0, or passed down the chain of receivers): versions arrive
bit-equal (checked against the manifest), a version a receiver still holds is not
overwritten by the next ones (receive buffers are reused only when nothing views them), and
a receiver SIGKILLed or stopped mid-version — at the end of the chain or in its middle —
delays the sender by at most the timeout, after which the channel is closed and stays
closed. The piece plan and the buffer pool are also checked on their own."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from astraflow.weights.collective import SOLO_BYTES, Buffers, Receiver, Sender, broadcast, open_group, plan
from astraflow.weights.publisher import Publisher
from astraflow.weights.tensors import xxh3

TIMEOUT_S = 3.0


def receiver(store: str, rank: int, world: int, relay: str, out, fail: str) -> None:
    """A worker's end in its own process: report each version's checksums and those of the
    version it held (as a follower does) while this one arrived, or die/stop on the first
    bucket after the header (`fail`)."""
    group = open_group(store, rank, world, TIMEOUT_S)
    rx = Receiver(group, TIMEOUT_S, bucket_mb=0.25, relay=relay)
    held = None
    try:
        while True:
            if fail:
                header = torch.zeros(3, dtype=torch.int64)
                broadcast(group, header, rx.timeout)
                broadcast(group, torch.empty(int(header[1]), dtype=torch.uint8), rx.timeout)
                first = torch.empty(rx.bucket, dtype=torch.uint8)  # the first bucket
                if relay == "chain":
                    group.recv([first], rank - 1, 0).wait(rx.timeout)
                else:
                    broadcast(group, first, rx.timeout)
                os.kill(os.getpid(), signal.SIGKILL if fail == "kill" else signal.SIGSTOP)
            tensors, manifest, _ = rx.receive()
            out.put((manifest.version, manifest.name, {n: xxh3(t) for n, t in tensors.items()},
                     None if held is None else (held[0], {n: xxh3(t) for n, t in held[1].items()})))
            held = (manifest.version, tensors)
            del tensors  # only the held version views a buffer while the next one arrives
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


def start(tmp_path, fails: list[str], relay: str):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=receiver, args=(store, r + 1, len(fails) + 1, relay, out, f), daemon=True)
             for r, f in enumerate(fails)]
    for p in procs:
        p.start()
    return Sender(open_group(store, 0, len(fails) + 1, 60), TIMEOUT_S, bucket_mb=0.25, relay=relay), procs, out


@pytest.mark.parametrize("relay,receivers", [("broadcast", 2), ("chain", 3)])
def test_versions_arrive_bit_equal_at_every_receiver(tmp_path, relay, receivers):
    sender, procs, out = start(tmp_path, [""] * receivers, relay)
    try:
        sent = {}
        for tensors, manifest in versions(tmp_path, 4):
            assert sender.send(tensors, manifest)
            sent[manifest.version] = (manifest.name, {n: info.xxh3 for n, info in manifest.tensors.items()})
        got = [out.get(timeout=30) for _ in range(receivers * len(sent))]
        assert sorted(v for v, *_ in got) == sorted(list(sent) * receivers)
        for version, name, sums, held in got:
            assert (name, sums) == sent[version]
            # the version held while this one arrived is intact (its buffer was not reused)
            assert held == (None if version == 1 else (version - 1, sent[version - 1][1]))
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("relay,fails", [("broadcast", ["", "kill"]), ("broadcast", ["", "stop"]),
                                         ("chain", ["kill", ""]), ("chain", ["", "stop"])])
def test_a_receiver_dying_mid_version_delays_the_sender_at_most_the_timeout(tmp_path, relay, fails):
    sender, procs, out = start(tmp_path, fails, relay)
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


def test_the_plan_sends_large_tensors_from_their_own_memory_and_packs_small_ones():
    spans = {"big": (0, 5 * SOLO_BYTES), "a": (5 * SOLO_BYTES, 10), "b": (5 * SOLO_BYTES + 16, 100),
             "empty": (5 * SOLO_BYTES + 120, 0), "mid": (5 * SOLO_BYTES + 120, SOLO_BYTES), "c": (6 * SOLO_BYTES + 120, 3)}
    pieces = plan(spans, bucket=2 * SOLO_BYTES)
    assert [(p.start, p.end, p.names, p.solo) for p in pieces] == [
        (0, 2 * SOLO_BYTES, ("big",), True), (2 * SOLO_BYTES, 4 * SOLO_BYTES, ("big",), True),
        (4 * SOLO_BYTES, 5 * SOLO_BYTES, ("big",), True),
        (5 * SOLO_BYTES, 5 * SOLO_BYTES + 116, ("a", "b"), False),
        (5 * SOLO_BYTES + 120, 6 * SOLO_BYTES + 120, ("mid",), True),
        (6 * SOLO_BYTES + 120, 6 * SOLO_BYTES + 123, ("c",), False)]
    # a pack never grows past the bucket
    small = {f"t{i}": (i * 64, 60) for i in range(10)}
    assert [p.names for p in plan(small, bucket=128)] == [(f"t{i}", f"t{i + 1}") for i in range(0, 10, 2)]


def test_a_receive_buffer_is_reused_only_when_nothing_views_it():
    buffers = Buffers()
    a = buffers.take(1000)
    held = a[8:16].view(torch.int16)  # a version's tensor, still held
    b = buffers.take(1000)
    assert b is not a
    assert buffers.take(1000) is b  # nothing views b: it is written again
    del held
    assert buffers.take(1000) in (a, b)
    views = [a[:10], b[:10]]
    c = buffers.take(1000)  # both viewed: a fresh one, and the pool stays at two buffers
    assert c is not a and c is not b and len(buffers.pool) == 2
    del views
