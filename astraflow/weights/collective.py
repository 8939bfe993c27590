"""Collective weight channel: inside one job, the trainer's rank 0 sends each version to the
rollout workers of its policy over a process group of their own (gloo, CPU tensors).

Never a hang: every operation of the sender runs under `weights.broadcast_timeout_s`; a
worker that dies or stops mid-version delays the trainer by about that much at most, after
which the sender closes the channel (one log line, which counts the whole delay) and
versions go over the filesystem only — which always carries every version too (the
collective channel only saves the workers' reads). A receiver waits for the next version
without a limit (the trainer may train for long) but for everything after its header under
the timeout; a receiver that fails stops listening and its worker follows the filesystem.

A version on the wire: a header [version, manifest bytes, payload bytes] (int64) and the
manifest JSON (`manifest.py`: its `tensors`, in order, give every tensor's name, shape, dtype
and checksum), both broadcast, then the payload — every tensor's bytes at an 8-byte-aligned
offset — in pieces that both ends derive from the manifest (`plan`): a tensor of at least
`SOLO_BYTES` is sent from its own memory (in chunks of at most `weights.bucket_mb`: no copy
on the sender), smaller ones packed together into buckets of at most `weights.bucket_mb`
(one copy each, into a staging buffer the sender keeps). Every piece goes straight into its
slice of the receiver's flat buffer, and each tensor is checked against the manifest's
checksum as soon as its last piece has arrived, while the next pieces arrive. The
receiver's tensors are views of that buffer, all verified before anyone sees them.

How the payload moves (`weights.relay`):
- `chain`: rank 0 sends each piece to rank 1, and every receiver forwards each piece to the
  next rank as soon as it has arrived, while the next ones arrive (`chain`). Rank 0 sends
  the payload once and every link carries it once, whatever the number of workers: the
  time for n workers is that for one plus n - 1 pieces. The last rank acknowledges the
  whole version to rank 0, so the sender learns of a break anywhere in the chain.
- `broadcast`: each piece is one gloo broadcast from rank 0 (`pipeline`), which sends it to
  every receiver itself, so its time grows with the number of workers (docs/benchmarks.md).
Either way `WINDOW` operations are in flight at a time (gloo's worker threads move bytes
while the sender stages the next pack and the receiver hashes what arrived).

Receive buffers are reused across versions (`Buffers`): a buffer is written again only when
no tensor outside the pool views its memory any more (torch's count of the storage's
users), so the tensors of a version a worker still holds (a follower keeps the last one it
took, to patch deltas into) are never overwritten; a worker holding one version while the
next arrives needs two buffers, which is what the pool keeps. A fresh buffer costs the
kernel's page faults on its first write, which on this machine's VM is several times the
transfer itself (docs/benchmarks.md).

The group: rank 0 the trainer's rank 0, ranks 1..n the rollout workers hosting the policy
(in worker order, which is the chain's order), meeting through a `FileStore` in the run's
rendezvous directory, named by the launch (`groups.py`: the local launcher and a het job's
tasks name each component's memberships with `weights.channel` auto or collective; gloo on
CPU tensors, also between GPU nodes: NCCL straight into the engines' parameters is not
built). Each end opens the group in a thread of its own,
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
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from astraflow.config.schema import RELAYS
from astraflow.weights.groups import membership, store_path
from astraflow.weights.manifest import Manifest, WeightsError, parse_manifest
from astraflow.weights.tensors import dtype_named, nbytes, xxh3

log = logging.getLogger(__name__)

ALIGN = 8
SOLO_BYTES = 1 << 20  # a tensor this large is broadcast from its own memory: no staging copy
WINDOW = 2  # broadcasts in flight: gloo's default worker threads per group
FOREVER = datetime.timedelta(days=365)  # a receiver's wait for the next version's header
SETUP_TIMEOUT_S = 300.0  # every member joins within this (a worker builds its engine first)
ACK_TAG = 1 << 30  # the chain's last rank to rank 0: the version arrived whole (pieces use tags 0, 1, ...)


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


@dataclass(frozen=True)
class Piece:
    """Payload bytes [start, end) broadcast in one operation: a chunk of one large tensor
    (`names` its name alone, `solo`) or small tensors packed together (with the padding
    between them)."""
    start: int
    end: int
    names: tuple[str, ...]
    solo: bool


def plan(spans: dict[str, tuple[int, int]], bucket: int) -> list[Piece]:
    """The payload's pieces, in order: each tensor of at least `SOLO_BYTES` in chunks of at
    most `bucket`, the others packed into pieces of at most `bucket` bytes."""
    pieces: list[Piece] = []
    pack: list[str] = []

    def close_pack() -> None:
        if pack:
            pieces.append(Piece(spans[pack[0]][0], sum(spans[pack[-1]]), tuple(pack), False))
            pack.clear()

    for name, (off, size) in spans.items():
        if size >= SOLO_BYTES:
            close_pack()
            pieces += [Piece(a, min(a + bucket, off + size), (name,), True) for a in range(off, off + size, bucket)]
        elif size:
            if pack and off + size - spans[pack[0]][0] > bucket:
                close_pack()
            pack.append(name)
    close_pack()
    return pieces


def open_group(store_path: Path, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """The channel's group (waits for every member, up to the timeout: RuntimeError then)."""
    store = dist.FileStore(str(store_path), world)
    return dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))


def start(group: dist.ProcessGroup, tensor: torch.Tensor, timeout: datetime.timedelta) -> dist.Work:
    """Rank 0's `tensor` into every member's, under `timeout`: the operation, in flight."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.timeout = 0, timeout
    return group.broadcast([tensor], opts)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
    """Rank 0's `tensor` into every member's, waited for at most `timeout` (RuntimeError then)."""
    start(group, tensor, timeout).wait(timeout)


def pipeline(group: dist.ProcessGroup, tensors: Iterator[torch.Tensor], timeout: datetime.timedelta,
             done: Callable[[int], None] = lambda i: None) -> None:
    """Broadcast each of `tensors` (taken from the iterator just before it is sent), `WINDOW`
    in flight; `done(i)` runs once the i-th has arrived, while the next ones are moving.
    RuntimeError when one fails or outlasts `timeout` (each is waited for at most that)."""
    inflight: deque[dist.Work] = deque()

    def issue() -> None:
        tensor = next(tensors, None)
        if tensor is not None:
            inflight.append(start(group, tensor, timeout))

    for _ in range(WINDOW):
        issue()
    i = 0
    while inflight:
        inflight.popleft().wait(timeout)
        issue()
        done(i)
        i += 1


def chain(group: dist.ProcessGroup, pieces: Iterator[torch.Tensor], timeout: datetime.timedelta,
          done: Callable[[int], None] = lambda i: None) -> None:
    """Pass each of `pieces` down the chain 0 -> 1 -> ... -> last: rank 0 sends its pieces (taken
    from the iterator just before each is sent); any other rank receives each into its piece
    from the rank before and forwards it to the rank after as soon as it has arrived, then
    runs `done(i)` while the next ones are moving. `WINDOW` receives and `WINDOW` sends in
    flight. RuntimeError when an operation fails or outlasts `timeout` (each is waited for at
    most that); every send has completed when this returns (rank 0 may reuse its buffers)."""
    rank, world = group.rank(), group.size()
    sends: deque[dist.Work] = deque()

    def forward(i: int, piece: torch.Tensor) -> None:
        if rank + 1 < world:
            sends.append(group.send([piece], rank + 1, i))
            if len(sends) > WINDOW:
                sends.popleft().wait(timeout)

    if rank == 0:
        for i, piece in enumerate(pieces):
            forward(i, piece)
    else:
        numbered = enumerate(pieces)
        recvs: deque[tuple[int, torch.Tensor, dist.Work]] = deque()

        def post() -> None:
            nxt = next(numbered, None)
            if nxt is not None:
                recvs.append((*nxt, group.recv([nxt[1]], rank - 1, nxt[0])))

        for _ in range(WINDOW):
            post()
        while recvs:
            i, piece, work = recvs.popleft()
            work.wait(timeout)
            post()
            forward(i, piece)
            done(i)
    while sends:
        sends.popleft().wait(timeout)


def move(group: dist.ProcessGroup, relay: str, pieces: Iterator[torch.Tensor], timeout: datetime.timedelta,
         done: Callable[[int], None] = lambda i: None) -> None:
    """The payload's pieces by `relay` (`chain` then its acknowledgement, or `pipeline`),
    `done(i)` as each piece has arrived; RuntimeError as theirs."""
    if relay == "chain":
        chain(group, pieces, timeout, done)
        acknowledge(group, timeout)
    else:
        pipeline(group, pieces, timeout, done)


def acknowledge(group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """The end of a chained version: its last rank tells rank 0 that everything arrived (and
    was verified); rank 0 waits for that, at most `timeout`. Other ranks: nothing."""
    last, flag = group.size() - 1, torch.ones(1, dtype=torch.int64)
    if last == 0:  # no receivers: nothing to acknowledge
        return
    if group.rank() == last:
        group.send([flag], 0, ACK_TAG).wait(timeout)
    elif group.rank() == 0:
        group.recv([flag], last, ACK_TAG).wait(timeout)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat (a view where it is contiguous on the CPU)."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def _users(buffer: torch.Tensor) -> int:
    """How many tensors (and storage handles) use `buffer`'s memory; -1 if torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)  # private, in torch since 2.1
    return -1 if count is None else count(buffer.untyped_storage()._cdata)


class Buffers:
    """A receiver's flat buffers, reused across versions: `take` gives one that no tensor
    outside the pool views (or a fresh one), keeping at most `keep`."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.pool: list[tuple[torch.Tensor, int]] = []  # (buffer, its users when only the pool holds it)

    def take(self, size: int) -> torch.Tensor:
        for buffer, alone in self.pool:
            if buffer.numel() == size and alone != -1 and _users(buffer) == alone:
                return buffer
        buffer = torch.empty(size, dtype=torch.uint8)
        # the oldest buffers leave the pool; one still viewed lives on with its views only
        self.pool = [b for b in self.pool if b[0].numel() == size][-(self.keep - 1):] if self.keep > 1 else []
        self.pool.append((buffer, _users(buffer)))
        return buffer


def bucket_bytes(bucket_mb: float) -> int:
    """`weights.bucket_mb` in bytes, a multiple of the payload's alignment."""
    return max(ALIGN, int(bucket_mb * 2**20) // ALIGN * ALIGN)


def check_relay(name: str) -> str:
    if name not in RELAYS:
        raise ValueError(f"relay {name!r}: expected one of {', '.join(RELAYS)}")
    return name


class Sender:
    """The trainer's end: `send` one version to every receiver, or close the channel."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, bucket_mb: float, relay: str) -> None:
        self.group: dist.ProcessGroup | None = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.bucket = bucket_bytes(bucket_mb)
        self.relay = check_relay(relay)
        self.staging = torch.empty(0, dtype=torch.uint8)  # the packs of small tensors, kept across versions

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
            move(self.group, self.relay, self._sources(tensors, spans), self.timeout)
            return True
        except RuntimeError as e:  # gloo: a peer closed the connection, or the timeout passed
            problem = str(e).splitlines()[0]
        # out of the handler (its traceback held the broadcasts in flight): dropping the group
        # destroys it, which waits for the other broadcast in flight, under its own timeout
        self.group = None
        log.error("collective weight channel closed after %.1f s sending v%d (%s); versions go over the "
                  "filesystem from now on", time.perf_counter() - t0, manifest.version, problem)
        return False

    def _sources(self, tensors: dict[str, torch.Tensor], spans: dict[str, tuple[int, int]]) -> Iterator[torch.Tensor]:
        """Each piece's bytes as it is about to be sent: a view of a large tensor, or its small
        tensors copied into their own region of the staging buffer (no piece in flight shares it)."""
        pieces = plan(spans, self.bucket)
        need = sum(p.end - p.start for p in pieces if not p.solo)
        if self.staging.numel() < need:
            self.staging = torch.empty(need, dtype=torch.uint8)
        at, current = 0, ("", torch.empty(0, dtype=torch.uint8))  # the large tensor being sent, as bytes
        for p in pieces:
            if p.solo:  # its chunks come one after another: its bytes are made once (a copy only off the CPU)
                if current[0] != p.names[0]:
                    current = (p.names[0], as_bytes(tensors[p.names[0]]))
                off = spans[p.names[0]][0]
                yield current[1][p.start - off:p.end - off]
                continue
            region = self.staging[at:at + p.end - p.start]
            for name in p.names:
                off, size = spans[name]
                region[off - p.start:off - p.start + size] = as_bytes(tensors[name])
            at += p.end - p.start
            yield region


class Receiver:
    """A worker's end: `receive` the next version, verified; WeightsError or RuntimeError if
    the channel failed (the caller stops listening)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, bucket_mb: float, relay: str) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.bucket = bucket_bytes(bucket_mb)
        self.relay = check_relay(relay)
        self.buffers = Buffers()

    def receive(self) -> tuple[dict[str, torch.Tensor], Manifest, int]:
        """(tensors, manifest, bytes received) of the next version: views of a buffer that is
        not written again while any of them lives."""
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
        flat = self.buffers.take(total)
        pieces = plan(spans, self.bucket)
        names = list(spans)  # in payload order
        tensors: dict[str, torch.Tensor] = {}

        def check(i: int) -> None:  # piece i arrived: check every tensor whose bytes all have
            end = pieces[i].end if i < len(pieces) - 1 else total  # the last: empty tensors after it too
            while len(tensors) < len(names) and sum(spans[names[len(tensors)]]) <= end:
                name = names[len(tensors)]
                off, size = spans[name]
                info = manifest.tensors[name]
                t = flat[off: off + size].view(dtype_named(info.dtype)).view(info.shape)
                if nbytes(t) != size or xxh3(t) != info.xxh3:
                    raise WeightsError(f"broadcast v{version}: {name} does not match its checksum")
                tensors[name] = t

        move(self.group, self.relay, (flat[p.start:p.end] for p in pieces), self.timeout, check)
        check(len(pieces))  # a payload of empty tensors only has no pieces
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
        self.sender = Sender(group, wcfg.broadcast_timeout_s, wcfg.bucket_mb, wcfg.relay)
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
                          wcfg.broadcast_timeout_s, wcfg.bucket_mb, wcfg.relay)
            log.info("collective weight channel for %s: joined as rank %d of %d", policy, *member)
            while True:
                deliver(*rx.receive())
        except (RuntimeError, WeightsError) as e:  # also the trainer's exit at the end of a run: a warning
            log.warning("collective weight channel for %s closed (%s); following the filesystem", policy,
                        str(e).splitlines()[0])

    threading.Thread(target=run, name=f"weights-{policy}", daemon=True).start()
