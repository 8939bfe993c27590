"""The control-plane contracts: every request and reply that crosses a process boundary.

Rollout worker <-> dataflow: Register, Heartbeat, Lease, Renew, Commit, Release, Weights.
Trainer <-> dataflow: Ready, Batch, Consumed, Published, Stopped.
Anyone: Status.

Invariants:
- `Register` and `Ready` carry `protocol_version`; the dataflow rank refuses a mismatch.
- A `Trajectory` is one token sequence as seen by one policy (on the wire, trajectories
  travel columnar as a `TrajectoryBatch`). Its per-token arrays have one length; `loss_mask` is 1 exactly on the tokens this policy generated and trains on;
  `token_policy` is the index (into the run's policy list) of the policy that generated each
  token, -1 for prompt, tool and environment tokens; `versions` is the weight version that
  generated each token (-1 where none did). Several policies' records may share one sequence.
- Task ids are assigned by the dataflow rank; sample ids are assigned when a trajectory is
  stored and are the unit of `Consumed`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np

from astraflow.protocol.wire import array_field

# 2: lease and commit replies carry `latest`; 3: `Stopped`; 4: signed header + body frames; 5: chat tasks;
# 6: `Published` says whether a version is a delta and on which version it depends (`full`, `base`);
# 7: `Batch.member`; 8: heartbeat and renew replies carry `latest` (`HeartbeatReply`, `RenewReply.latest`)
PROTOCOL_VERSION = 8


@dataclass(frozen=True)
class Trajectory:
    """One record, as a workflow builds it. On the wire records travel as a TrajectoryBatch."""
    policy: str
    tokens: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    token_policy: np.ndarray
    reward: float = 0.0
    episode_id: int = 0
    group_id: int = 0
    gen_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


TOKEN_FIELDS = ("tokens", "logprobs", "loss_mask", "versions", "token_policy")
ROW_FIELDS = ("reward", "episode_id", "group_id", "gen_s")


@dataclass(frozen=True)
class TrajectoryBatch:
    """n trajectories, columnar: per-token arrays concatenated, `lengths` splits them.

    This is the wire form of trajectories (commits and served batches): decoding costs a few
    array views per batch instead of a dozen objects per trajectory, and a trainer gets the
    packed layout it needs anyway.
    """
    policy: list[str]
    lengths: np.ndarray = array_field("int32")
    tokens: np.ndarray = array_field("int32")
    logprobs: np.ndarray = array_field("float32")
    loss_mask: np.ndarray = array_field("uint8")
    versions: np.ndarray = array_field("int32")
    token_policy: np.ndarray = array_field("int8")
    reward: np.ndarray = array_field("float32")
    episode_id: np.ndarray = array_field("int64")
    group_id: np.ndarray = array_field("int64")
    gen_s: np.ndarray = array_field("float32")
    meta: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.lengths)
        for name in ("policy", *ROW_FIELDS, "meta"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} trajectories")
        if n and int(self.lengths.min()) < 1:
            raise ValueError("every trajectory needs at least one token")
        total = int(self.lengths.sum(dtype=np.int64))
        for name in TOKEN_FIELDS:
            if len(getattr(self, name)) != total:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, lengths sum to {total}")

    def __len__(self) -> int:
        return len(self.lengths)

    @cached_property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def trajectory(self, i: int) -> Trajectory:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return Trajectory(self.policy[i], *(getattr(self, c)[lo:hi] for c in TOKEN_FIELDS),
                          float(self.reward[i]), int(self.episode_id[i]), int(self.group_id[i]),
                          float(self.gen_s[i]), self.meta[i])

    @staticmethod
    def from_trajectories(trajs: list[Trajectory]) -> "TrajectoryBatch":
        def col(name: str, dtype: str) -> np.ndarray:
            return np.concatenate([np.asarray(getattr(t, name), dtype) for t in trajs]) if trajs else np.zeros(0, dtype)
        return TrajectoryBatch(
            policy=[t.policy for t in trajs], lengths=np.array([len(t.tokens) for t in trajs], np.int32),
            tokens=col("tokens", "int32"), logprobs=col("logprobs", "float32"), loss_mask=col("loss_mask", "uint8"),
            versions=col("versions", "int32"), token_policy=col("token_policy", "int8"),
            reward=np.array([t.reward for t in trajs], np.float32),
            episode_id=np.array([t.episode_id for t in trajs], np.int64),
            group_id=np.array([t.group_id for t in trajs], np.int64),
            gen_s=np.array([t.gen_s for t in trajs], np.float32), meta=[t.meta for t in trajs])

    @staticmethod
    def gather(parts: list[tuple["TrajectoryBatch", int]]) -> "TrajectoryBatch":
        """Trajectory `i` of batch `b` for each (b, i), in order, as one batch."""
        cols = {}
        for c in TOKEN_FIELDS:
            pieces = [getattr(b, c)[b.offsets[i]:b.offsets[i + 1]] for b, i in parts]
            cols[c] = np.concatenate(pieces) if pieces else np.zeros(0, _DTYPES[c])
        for c in ("lengths", *ROW_FIELDS):
            cols[c] = np.array([getattr(b, c)[i] for b, i in parts], _DTYPES[c])
        return TrajectoryBatch(policy=[b.policy[i] for b, i in parts], meta=[b.meta[i] for b, i in parts], **cols)


_DTYPES = {f.name: f.metadata["dtype"] for f in fields(TrajectoryBatch) if "dtype" in f.metadata}


@dataclass(frozen=True)
class Task:
    task_id: int
    lease_s: float
    prompt: str
    answer: str
    group_size: int
    policies: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)  # chat messages in place of the prompt
    solution: str = ""  # a worked solution (reference guidance); "" = the answer
    row: dict[str, Any] = field(default_factory=dict)  # the data set row's other fields (user rewards)

    @property
    def target(self) -> str:
        return self.solution or self.answer


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
    engine_load_s: float = 0.0  # how long the worker took to load its engines (elastic bench)


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
    trajectories: TrajectoryBatch
    versions: dict[str, int] = field(default_factory=dict)  # versions the task ran with


@dataclass(frozen=True)
class Release:
    """Hand leases back without committing (draining, preemption); `leaving`: the worker is
    exiting, so it is no longer counted alive (rather than after the heartbeat timeout)."""
    worker_id: str
    task_ids: list[int]
    leaving: bool = False


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
    rank: int = 0  # the asking rank's data-parallel rank: it is dealt the step's rows rank::world
    world: int = 1  # data-parallel ranks (trainer.world / (tp x pp))
    version: int = 0  # the trainer's current weight version (for the staleness bound)
    # which rank of one model replica (its tensor- and pipeline-parallel group, tp x pp ranks)
    # asks: every member of a replica is served the same rows
    member: int = 0


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
    # A delta version (`full` false) is read on top of `base`, the URI of the version it was
    # made against: retention keeps a kept version's base too (the rank never reads manifests).
    full: bool = True
    base: str = ""


@dataclass(frozen=True)
class Stopped:
    """A trainer group stopped on a signal with `step` checkpointed (sent by its rank 0). On
    Slurm's warning the dataflow task keeps the rank serving until every trainer has said so:
    a trainer in the middle of a step needs the rank to acknowledge it before checkpointing."""
    policy: str
    step: int


@dataclass(frozen=True)
class Status:
    pass


RETIRE_GRACE_S = 10.0  # a drained worker's episodes in flight get this long, then are handed back


@dataclass(frozen=True)
class Drain:
    """Retire these workers (base ids): they get no new tasks, finish or hand back what they
    hold and exit. Sent by the launcher before it cancels their Slurm jobs."""
    worker_bases: list[str]


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
    # why fewer tasks than asked: "backpressure", "stale_weights", "no_matching_policies",
    # "drained" (all handed out, leased ones may return), "exhausted" (no task will come) or
    # "retire" (this worker is being drained: finish or hand back what it holds, then exit)
    reason: str = ""
    latest: dict[str, int] = field(default_factory=dict)  # newest published version per policy


@dataclass(frozen=True)
class RenewReply:
    renewed: list[int]
    lost: list[int]  # expired and handed to someone else, or already committed
    latest: dict[str, int] = field(default_factory=dict)  # as LeaseReply's


@dataclass(frozen=True)
class HeartbeatReply:
    # as LeaseReply's: a worker that only heartbeats (long episodes) still hears of new
    # versions without polling `Weights`
    latest: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CommitReply:
    status: str  # "stored" | "duplicate"
    sample_ids: list[int]
    # newest published version per policy: a worker learns of new weights with every commit,
    # instead of only when it next polls (polling alone, 15% of the quickstart's samples were
    # generated too far behind a trainer stepping every 0.12 s and dropped as stale)
    latest: dict[str, int] = field(default_factory=dict)


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
    """Stored trajectories as served to a trainer, with their data-policy annotations."""
    step: int
    replay: bool  # the same samples this step was trained on before (trainer resumed)
    trajectories: TrajectoryBatch
    sample_ids: np.ndarray = array_field("int64")
    task_ids: np.ndarray = array_field("int64")
    advantages: np.ndarray = array_field("float32")
    group_mean: np.ndarray = array_field("float32")
    group_std: np.ndarray = array_field("float32")
    # Reward of everything generated for this policy since the previous batch, filtered groups
    # included: the served samples alone overstate it (all-wrong groups are never served).
    generated_reward_mean: float = 0.0
    generated_count: int = 0


@dataclass(frozen=True)
class StatusReply:
    status: dict[str, Any]


REQUESTS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (Register, Heartbeat, Lease, Renew, Commit, Release, Weights,
                Ready, Batch, Consumed, Published, Stopped, Status, Drain)
}
REPLIES: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (Ok, Error, RegisterReply, HeartbeatReply, LeaseReply, RenewReply, CommitReply, WeightsReply,
                ReadyReply, BatchReply, StatusReply)
}
