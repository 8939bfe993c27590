"""Task table: queued -> leased -> done, with leases on the dataflow rank's monotonic clock.

Invariants:
- a task id is in at most one of `queued`, `leased`, `done`;
- a lease is a duration measured here, never a wall-clock deadline sent by a peer;
- an expired lease returns the task to the front of the queue (it is the oldest work);
- the first commit of a task wins; any later commit of it is a duplicate, whoever holds it;
- a leased task is committed only by its holder (checked by the state machine); a task
  nobody holds (expired, handed back) takes a late commit from any registered worker (its
  previous holder, as a rule).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np


class TaskSet:
    """The committed task ids: a bitmap over 0 .. the highest id (task ids are handed out in
    order), a bit each where a set of ints took ~60 bytes a task (10 M tasks: 600 MB)."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._bits = np.zeros(1024, bool)
        self._n = 0
        for tid in ids:
            self.add(tid)

    def add(self, tid: int) -> None:
        if tid >= len(self._bits):
            self._bits = np.concatenate([self._bits, np.zeros(max(tid + 1, len(self._bits) // 2), bool)])
        if not self._bits[tid]:
            self._bits[tid] = True
            self._n += 1

    def add_many(self, ids: np.ndarray) -> None:
        if len(ids):
            self.add(int(ids.max()))  # room for all
            self._bits[ids] = True
            self._n = int(self._bits.sum())

    def __contains__(self, tid: int) -> bool:
        return 0 <= tid < len(self._bits) and bool(self._bits[tid])

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._bits).tolist())

    def highest(self) -> int:
        """The highest committed id, -1 with none."""
        nonzero = np.flatnonzero(self._bits)
        return int(nonzero[-1]) if len(nonzero) else -1

    def packed(self) -> tuple[np.ndarray, int]:
        """The bitmap packed 8 ids a byte, and its length (`unpacked` reverses it)."""
        return np.packbits(self._bits), len(self._bits)

    @classmethod
    def unpacked(cls, packed: np.ndarray, n: int) -> "TaskSet":
        tasks = cls()
        tasks._bits = np.unpackbits(packed, count=n).astype(bool)
        tasks._n = int(tasks._bits.sum())
        return tasks

    def missing_below(self, end: int) -> np.ndarray:
        """The ids below `end` not in the set."""
        bits = np.zeros(end, bool)
        n = min(end, len(self._bits))
        bits[:n] = self._bits[:n]
        return np.flatnonzero(~bits)


@dataclass
class Lease:
    worker: str
    deadline: float
    serial: int  # distinguishes this lease from earlier ones of the same task
    versions: dict[str, int] = field(default_factory=dict)


class TaskTable:
    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.next_id = 0  # the next fresh task id
        self.queued: deque[int] = deque()  # handed back / expired tasks, served first
        self.leased: dict[int, Lease] = {}
        self.done = TaskSet()
        self.requeued = 0
        self._heap: list[tuple[float, int, int]] = []
        self._serial = 0

    @property
    def exhausted(self) -> bool:
        return not self.queued and self.limit is not None and self.next_id >= self.limit

    def take(self) -> int | None:
        while self.queued:
            tid = self.queued.popleft()
            if tid not in self.done and tid not in self.leased:
                return tid
        if self.limit is not None and self.next_id >= self.limit:
            return None
        self.next_id += 1
        return self.next_id - 1

    def lease(self, tid: int, worker: str, now: float, duration: float, versions: dict[str, int]) -> Lease:
        self._serial += 1
        lease = Lease(worker, now + duration, self._serial, dict(versions))
        self.leased[tid] = lease
        heapq.heappush(self._heap, (lease.deadline, tid, lease.serial))
        return lease

    def renew(self, tid: int, worker: str, now: float, duration: float) -> bool:
        lease = self.leased.get(tid)
        if lease is None or lease.worker != worker:
            return False
        lease.deadline = now + duration
        heapq.heappush(self._heap, (lease.deadline, tid, lease.serial))
        return True

    def release(self, tid: int, worker: str | None = None) -> bool:
        """Put a leased task back at the front of the queue (worker gone, drained, expired)."""
        lease = self.leased.get(tid)
        if lease is None or (worker is not None and lease.worker != worker):
            return False
        del self.leased[tid]
        self.queued.appendleft(tid)
        self.requeued += 1
        return True

    def expire(self, now: float) -> list[int]:
        expired = []
        while self._heap and self._heap[0][0] <= now:
            deadline, tid, serial = heapq.heappop(self._heap)
            lease = self.leased.get(tid)
            if lease is not None and lease.serial == serial and lease.deadline <= now:
                self.release(tid)
                expired.append(tid)
        return expired

    def complete(self, tid: int) -> Lease | None:
        """Mark committed; returns the lease that was open on it, if any."""
        self.done.add(tid)
        return self.leased.pop(tid, None)

    def next_deadline(self) -> float | None:
        while self._heap:
            deadline, tid, serial = self._heap[0]
            lease = self.leased.get(tid)
            if lease is not None and lease.serial == serial and lease.deadline == deadline:
                return deadline
            heapq.heappop(self._heap)
        return None

    def recover(self, done: TaskSet, high_water: int) -> None:
        """After a restart: everything below the high-water mark (and the task limit: the mark
        is journalled in blocks, and may be beyond it) that is not done is queued."""
        self.done = done
        self.next_id = max(high_water, done.highest() + 1)
        end = self.next_id if self.limit is None else min(self.next_id, self.limit)
        self.queued = deque(done.missing_below(end).tolist())
