"""The control-plane contracts: every request and reply that crosses a process boundary.

Rollout worker <-> dataflow: Register, Heartbeat, Lease, Renew, Commit, Release, Weights.
Trainer <-> dataflow: Ready, Batch, Consumed, Published.
Anyone: Status.

Invariants:
- `Register` and `Ready` carry `protocol_version`; the dataflow rank refuses a mismatch.
- A `Trajectory` is one token sequence as seen by one policy. Its per-token arrays have one
  length; `loss_mask` is 1 exactly on the tokens this policy generated and trains on;
  `token_policy` is the index (into the run's policy list) of the policy that generated each
  token, -1 for prompt, tool and environment tokens; `versions` is the weight version that
  generated each token (-1 where none did). Several policies' records may share one sequence.
- Task ids are assigned by the dataflow rank; sample ids are assigned when a trajectory is
  stored and are the unit of `Consumed`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astraflow.protocol.wire import array_field

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Trajectory:
    policy: str
    tokens: np.ndarray = array_field("int32")
    logprobs: np.ndarray = array_field("float32")
    loss_mask: np.ndarray = array_field("uint8")
    versions: np.ndarray = array_field("int32")
    token_policy: np.ndarray = array_field("int8")
    reward: float = 0.0
    episode_id: int = 0
    group_id: int = 0
    gen_s: float = 0.0
    # Free metadata: msgpack-native values only (extra reward components, tool calls, ...).
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("logprobs", "loss_mask", "versions", "token_policy"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, tokens has {n}")
        if n == 0:
            raise ValueError("empty trajectory")


@dataclass(frozen=True)
class Task:
    task_id: int
    lease_s: float
    prompt: str
    answer: str
    group_size: int
    policies: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """A stored trajectory as served to a trainer, with its data-policy annotations."""
    sample_id: int
    task_id: int
    trajectory: Trajectory
    advantage: float
    group_mean: float
    group_std: float


# ------------------------------------------------------------------ requests


@dataclass(frozen=True)
class Register:
    protocol_version: int
    worker_id: str  # stable base id, e.g. "slurm-1234_7" or "local-0"
    policies: list[str]
    capacity: int
    hardware: str = ""
    partition: str = ""
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    versions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Lease:
    worker_id: str
    n: int
    versions: dict[str, int] = field(default_factory=dict)  # weights the worker runs now


@dataclass(frozen=True)
class Renew:
    worker_id: str
    task_ids: list[int]


@dataclass(frozen=True)
class Commit:
    worker_id: str
    task_id: int
    trajectories: list[Trajectory]
    versions: dict[str, int] = field(default_factory=dict)  # versions the task ran with


@dataclass(frozen=True)
class Release:
    """Hand leases back without committing (draining, preemption)."""
    worker_id: str
    task_ids: list[int]


@dataclass(frozen=True)
class Weights:
    policy: str


@dataclass(frozen=True)
class Ready:
    protocol_version: int
    policy: str
    resume_step: int  # last step whose update is in the checkpoint the trainer resumed from
    hardware: str = ""
    partition: str = ""
    world: int = 1


@dataclass(frozen=True)
class Batch:
    policy: str
    step: int  # the step this batch will be trained in (resume_step + 1, + 2, ...)
    n: int  # samples in the whole step (all ranks together)
    rank: int = 0
    world: int = 1
    version: int = 0  # the trainer's current weight version (for the staleness bound)


@dataclass(frozen=True)
class Consumed:
    policy: str
    step: int
    sample_ids: list[int]


@dataclass(frozen=True)
class Published:
    policy: str
    version: int
    uri: str
    # Versions still referenced by checkpoints: retention never deletes them.
    pinned: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Status:
    pass


# ------------------------------------------------------------------ replies


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Error:
    code: str  # bad_request | unauthorized | replayed | oversized | version_mismatch | unknown | ...
    message: str


@dataclass(frozen=True)
class RegisterReply:
    worker_id: str  # base id + restart counter, e.g. "slurm-1234_7.r2"
    lease_s: float
    heartbeat_s: float


@dataclass(frozen=True)
class LeaseReply:
    tasks: list[Task]
    retry_after_s: float = 0.0
    reason: str = ""  # why fewer tasks than asked: "backpressure", "stale_weights", "exhausted"


@dataclass(frozen=True)
class RenewReply:
    renewed: list[int]
    lost: list[int]  # expired and handed to someone else, or already committed


@dataclass(frozen=True)
class CommitReply:
    status: str  # "stored" | "duplicate"
    sample_ids: list[int]


@dataclass(frozen=True)
class WeightsReply:
    version: int  # -1: nothing published yet
    uri: str


@dataclass(frozen=True)
class ReadyReply:
    replay_steps: list[int]  # steps after resume_step that will be re-served as they were
    latest_version: int


@dataclass(frozen=True)
class BatchReply:
    step: int
    samples: list[Sample]
    replay: bool  # the same samples this step was trained on before (trainer resumed)


@dataclass(frozen=True)
class StatusReply:
    status: dict[str, Any]


REQUESTS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (Register, Heartbeat, Lease, Renew, Commit, Release, Weights,
                Ready, Batch, Consumed, Published, Status)
}
REPLIES: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (Ok, Error, RegisterReply, LeaseReply, RenewReply, CommitReply, WeightsReply,
                ReadyReply, BatchReply, StatusReply)
}
