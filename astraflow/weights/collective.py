"""Collective weight channel: inside one job, the trainer's rank 0 broadcasts each version to
the rollout workers of its policy over a process group of their own (gloo, CPU tensors).

Never a hang: every operation of the sender runs under `weights.broadcast_timeout_s`; a
worker that dies or stops mid-broadcast delays the trainer by at most that much, after which
the sender closes the channel (one log line) and versions go over the filesystem only —
which always carries every version too (the collective channel only saves the workers'
reads). A receiver waits for the next version without a limit (the trainer may train for
long) but for everything after its header under the timeout; a receiver that fails stops
listening and its worker follows the filesystem.

A version on the wire: a header [version, manifest bytes, payload bytes] (int64), the
manifest JSON (`manifest.py`: its `tensors`, in order, give every tensor's name, shape, dtype
and checksum), then the payload — every tensor's bytes at an 8-byte-aligned offset — in
buckets of `weights.bucket_mb`, each received straight into its slice of the receiver's
flat buffer. The receiver's tensors are views of that buffer, checked against the
manifest's checksums before anyone sees them.

The group: rank 0 the trainer's rank 0, ranks 1..n the rollout workers hosting the policy
(in worker order), meeting through a `FileStore` in the run's rendezvous directory, named by
the launch (`groups.py`: the local launcher and a het job's tasks name each component's
memberships with `weights.channel` auto or collective; gloo on CPU tensors, also between
GPU nodes: NCCL straight into the engines' parameters is not built). Each end opens the group in a thread of its own,
waiting up to `SETUP_TIMEOUT_S` for every member (a worker imports its engine first), while
the trainer trains and the worker follows the filesystem. Only a component's first start
joins: a restarted trainer or worker cannot rejoin the group its earlier incarnation left,
and follows the filesystem.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from astraflow.weights.groups import membership, store_path
from astraflow.weights.manifest import Manifest, WeightsError, parse_manifest
from astraflow.weights.tensors import dtype_named, nbytes, xxh3

log = logging.getLogger(__name__)

ALIGN = 8
FOREVER = datetime.timedelta(days=365)  # a receiver's wait for the next version's header
SETUP_TIMEOUT_S = 300.0  # every member joins within this (a worker builds its engine first)


def layout(manifest: Manifest) -> tuple[dict[str, tuple[int, int]], int]:
    """Each tensor's (offset, bytes) in the payload, in manifest order, and the payload's size."""
    spans, offset = {}, 0
    for name, info in manifest.tensors.items():
        size = dtype_named(info.dtype).itemsize
        for d in info.shape:
            size *= d
        spans[name] = (offset, size)
        offset += size + (-size % ALIGN)
    return spans, offset


def open_group(store_path: Path, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """The channel's group (waits for every member, up to the timeout: RuntimeError then)."""
    store = dist.FileStore(str(store_path), world)
    return dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
    """Rank 0's `tensor` into every member's, waited for at most `timeout` (RuntimeError then)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.timeout = 0, timeout
    group.broadcast([tensor], opts).wait(timeout)


class Sender:
    """The trainer's end: `send` one version to every receiver, or close the channel."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, bucket_mb: float) -> None:
        self.group: dist.ProcessGroup | None = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.bucket = max(ALIGN, int(bucket_mb * 2**20) // ALIGN * ALIGN)

    @property
    def open(self) -> bool:
        return self.group is not None

    def send(self, tensors: dict[str, torch.Tensor], manifest: Manifest) -> bool:
        """Broadcast the version `manifest` describes (`tensors`: its weights, publish dtype).
        False, and the channel closed, if any operation failed or timed out."""
        if self.group is None:
            return False
        t0 = time.perf_counter()
        try:
            text = json.dumps({"name": manifest.name, "manifest": manifest.to_json()})
            meta = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
            spans, total = layout(manifest)
            broadcast(self.group, torch.tensor([manifest.version, len(meta), total], dtype=torch.int64), self.timeout)
            broadcast(self.group, meta, self.timeout)
            flat = {name: tensors[name].detach().cpu().contiguous().view(-1).view(torch.uint8) for name in spans}
            staging = torch.empty(min(self.bucket, total), dtype=torch.uint8)
            for a in range(0, total, self.bucket):
                b = min(a + self.bucket, total)
                for name, (off, size) in spans.items():  # the pieces of each tensor inside [a, b)
                    lo, hi = max(a, off), min(b, off + size)
                    if lo < hi:
                        staging[lo - a:hi - a] = flat[name][lo - off:hi - off]
                broadcast(self.group, staging[: b - a], self.timeout)
        except RuntimeError as e:  # gloo: a peer closed the connection, or the timeout passed
            log.error("collective weight channel closed after %.1f s sending v%d (%s); versions go over the "
                      "filesystem from now on", time.perf_counter() - t0, manifest.version, str(e).splitlines()[0])
            self.group = None
            return False
        return True


class Receiver:
    """A worker's end: `receive` the next version, verified; WeightsError or RuntimeError if
    the channel failed (the caller stops listening)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, bucket_mb: float) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.bucket = max(ALIGN, int(bucket_mb * 2**20) // ALIGN * ALIGN)

    def receive(self) -> tuple[dict[str, torch.Tensor], Manifest, int]:
        """(tensors, manifest, bytes received) of the next version."""
        header = torch.zeros(3, dtype=torch.int64)
        broadcast(self.group, header, FOREVER)  # the next version comes when the trainer has one
        version, meta_len, total = (int(x) for x in header)
        meta = torch.empty(meta_len, dtype=torch.uint8)
        broadcast(self.group, meta, self.timeout)
        try:
            d = json.loads(bytes(meta.numpy()).decode())
            manifest = parse_manifest(d["manifest"], str(d["name"]), f"broadcast v{version}")
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"broadcast v{version}: unreadable header ({e})") from None
        spans, expected = layout(manifest)
        if expected != total:
            raise WeightsError(f"broadcast v{version}: {total} payload bytes, the manifest makes {expected}")
        flat = torch.empty(total, dtype=torch.uint8)
        for a in range(0, total, self.bucket):
            broadcast(self.group, flat[a: min(a + self.bucket, total)], self.timeout)
        tensors = {}
        for name, (off, size) in spans.items():
            info = manifest.tensors[name]
            t = flat[off: off + size].view(dtype_named(info.dtype)).view(info.shape)
            if nbytes(t) != size or xxh3(t) != info.xxh3:
                raise WeightsError(f"broadcast v{version}: {name} does not match its checksum")
            tensors[name] = t
        return tensors, manifest, total


class TrainerChannel:
    """The trainer's end for one policy: opens the group in a thread, then `send`s versions."""

    def __init__(self, run_path: Path, policy: str, wcfg) -> None:
        self.policy, self.sender = policy, None
        member = membership(policy)
        if member is not None:
            threading.Thread(target=self._connect, args=(store_path(run_path, policy), member[1], wcfg),
                             name=f"weights-{policy}", daemon=True).start()

    def _connect(self, store: Path, world: int, wcfg) -> None:
        try:
            group = open_group(store, 0, world, SETUP_TIMEOUT_S)
        except RuntimeError as e:
            log.error("collective weight channel for %s not set up (%s); versions go over the filesystem",
                      self.policy, str(e).splitlines()[0])
            return
        self.sender = Sender(group, wcfg.broadcast_timeout_s, wcfg.bucket_mb)
        log.info("collective weight channel for %s: %d workers joined", self.policy, world - 1)

    def send(self, tensors: dict[str, torch.Tensor], manifest: Manifest) -> float | None:
        """Seconds the broadcast took; None if the channel is not (or no longer) open."""
        sender = self.sender
        if sender is None or not sender.open:
            return None
        t0 = time.perf_counter()
        return time.perf_counter() - t0 if sender.send(tensors, manifest) else None


def listen(run_path: Path, policy: str, wcfg, deliver: Callable[[dict[str, torch.Tensor], Manifest, int], None]) -> None:
    """A worker's end for one policy, when it is a member: a thread that opens the group and
    hands every version it receives to `deliver` (called in that thread), until it fails."""
    member = membership(policy)
    if member is None:
        return

    def run() -> None:
        try:
            rx = Receiver(open_group(store_path(run_path, policy), member[0], member[1], SETUP_TIMEOUT_S),
                          wcfg.broadcast_timeout_s, wcfg.bucket_mb)
            log.info("collective weight channel for %s: joined as rank %d of %d", policy, *member)
            while True:
                deliver(*rx.receive())
        except (RuntimeError, WeightsError) as e:  # also the trainer's exit at the end of a run: a warning
            log.warning("collective weight channel for %s closed (%s); following the filesystem", policy,
                        str(e).splitlines()[0])

    threading.Thread(target=run, name=f"weights-{policy}", daemon=True).start()
