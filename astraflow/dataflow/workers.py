"""Worker registry: who is alive, what it hosts, what it has produced.

A worker registers with a stable base id (`local-3`, `slurm-1234_7`); each registration of
the same base id is a new incarnation `<base>.r<k>` (k counts restarts, journalled), so ids
stay meaningful across restarts while leases of a dead incarnation are never confused with
the new one's. Any request from a worker counts as a heartbeat; a worker silent for longer
than the heartbeat timeout is declared dead and its leases are handed out again.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class WorkerInfo:
    worker_id: str
    base: str
    policies: tuple[str, ...]
    capacity: int
    hardware: str
    partition: str
    host: str
    last_seen: float
    pid: int = 0
    versions: dict[str, int] = field(default_factory=dict)
    alive: bool = True
    trajectories: int = 0
    tokens: int = 0
    recent: deque = field(default_factory=deque)  # (time, trajectories, tokens) per commit


class WorkerRegistry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self.restarts: dict[str, int] = {}

    def register(self, base: str, now: float, **attrs) -> WorkerInfo:
        k = self.restarts.get(base, -1) + 1
        self.restarts[base] = k
        info = WorkerInfo(worker_id=f"{base}.r{k}", base=base, last_seen=now, **attrs)
        self.workers[info.worker_id] = info
        return info

    def previous_incarnations(self, info: WorkerInfo) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.base == info.base and w is not info and w.alive]

    def seen(self, worker_id: str, now: float) -> WorkerInfo | None:
        info = self.workers.get(worker_id)
        if info is not None and info.alive:
            info.last_seen = now
            return info
        return None

    def sweep(self, now: float, timeout: float) -> list[WorkerInfo]:
        dead = [w for w in self.workers.values() if w.alive and now - w.last_seen > timeout]
        for w in dead:
            w.alive = False
        return dead

    def record_commit(self, worker_id: str, now: float, n: int, tokens: int, window: float) -> None:
        info = self.workers.get(worker_id)
        if info is None:
            return
        info.trajectories += n
        info.tokens += tokens
        info.recent.append((now, n, tokens))
        while info.recent and info.recent[0][0] < now - window:
            info.recent.popleft()

    @property
    def alive(self) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive]
