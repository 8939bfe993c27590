"""Shared fixtures: real run directories, a real dataflow rank process, real clients."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from astraflow.config.rundir import RunDir
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, read_rendezvous, wait_rendezvous
from astraflow.store.writer import RowBatch
from tests.ci_skips import (pytest_configure, pytest_make_collect_report,  # noqa: F401 (hooks: skips fail under CI)
                            pytest_runtest_makereport, pytest_runtest_setup)

REPO = Path(__file__).resolve().parents[1]

BASE_CONFIG = """
run: {name: test, seed: 0}
dataflow: {interface: loopback, lease_s: 30, heartbeat_timeout_s: 30}
store: {shard_max_mb: 64}
tasks: {kind: arithmetic, seed: 0, heldout: 200, group_size: 4}
policies:
  - {name: policy, max_staleness: 2, buffer_capacity: 4096}
"""


def make_run(tmp_path: Path, extra: list[str] = (), config: str = BASE_CONFIG) -> RunDir:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config)
    return RunDir.create(tmp_path / "run", cfg, list(extra))


class DataflowProcess:
    """`astraflow dataflow` as a real child process."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.proc: subprocess.Popen | None = None
        self.log = run.path / "logs" / "dataflow.log"

    def start(self, timeout_s: float = 30.0) -> dict:
        before = time.time()
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "astraflow.cli.main", "dataflow", "--run-dir", str(self.run.path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dataflow rank exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                info = read_rendezvous(self.run.path)
                if info["started"] > before and info["pid"] == self.proc.pid:
                    return info
            except (FileNotFoundError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(self.log.read_text())
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return make_run(tmp_path)


@pytest.fixture
def dataflow(run: RunDir):
    proc = DataflowProcess(run)
    proc.start()
    yield proc
    proc.stop()


def client(run: RunDir, timeout_s: float = 10.0) -> Client:
    return Client(wait_rendezvous(run.path)["address"], run.read_secret(), timeout_s=timeout_s)


def register(c: Client, worker_id: str = "w0", policies: tuple[str, ...] = ("policy",)) -> str:
    reply = c.call(m.Register(m.PROTOCOL_VERSION, worker_id, list(policies), capacity=4, partition="local"))
    return reply.worker_id


def parity_prompts(path: Path) -> Path:
    """A JSONL task a tiny model learns from a random init within seconds: a number's parity."""
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"prompt": f"{a}?", "answer": str(a % 2)}) + "\n"
                            for a in rng.choice(1000, 800, replace=False)))
    return path


def component_pids(run_dir: Path, role: str) -> list[int]:
    """Pids of a run's `astraflow <role>` processes (dataflow, train, rollout, node), from /proc."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"astraflow.cli.main" in cmd and role.encode() in cmd and str(run_dir).encode() in cmd:
                pids.append(int(d.name))
    return pids


def require(module: str):
    """Import an optional heavy dependency, or skip saying why (under CI=true: fail, `ci_skips`)."""
    return pytest.importorskip(module, reason=f"{module} is not installed here (make test installs it)")


def hf_engine(model_dir: Path, seed: int = 0, **kw):
    """An hf engine on `model_dir`, with the directory's tokenizer as `.tok` (tests only: a
    worker keeps its tokenizer apart from its engines)."""
    from astraflow.models.tokenizer import ModelTokenizer
    from astraflow.rollout.engines.hf import HFEngine

    engine = HFEngine(model_dir, seed=seed)
    engine.tok = ModelTokenizer(model_dir, **kw)
    return engine


def constant(value: float):
    """A reward that gives every completion `value` (as a Scorer is called)."""
    async def reward(completion: str, answer: str, row: dict | None = None) -> float:
        return value
    return reward


STORE_POLICIES = ("solver", "verifier")


def recovered_state(run_dir: Path):
    """A DataflowState on RUN_DIR after `recover()`, on a fixed clock; closed again if recovery
    refuses the run (so the refusal's test leaves no open shard behind)."""
    from astraflow.dataflow.state import DataflowState
    state = DataflowState(run_dir, RunDir.open(run_dir).config, clock=lambda: 1000.0)
    try:
        state.recover()
    except BaseException:
        state.close()
        raise
    return state


def make_batch(first_id: int, n: int, tokens: int = 50, seed: int = 0) -> RowBatch:
    """n random trajectories of `tokens` tokens for the store, sample ids from `first_id`."""
    rng = np.random.default_rng(seed + first_id)
    total = n * tokens
    return RowBatch(
        tokens={"tokens": rng.integers(0, 1 << 30, total, dtype=np.int32),
                "logprobs": -rng.random(total, dtype=np.float32),
                "loss_mask": rng.integers(0, 2, total).astype(np.uint8),
                "versions": rng.integers(0, 5, total).astype(np.int32),
                "token_policy": rng.integers(-1, 2, total).astype(np.int8)},
        rows={"sample_id": np.arange(first_id, first_id + n, dtype=np.int64),
              "task_id": np.full(n, first_id // n, np.int64), "episode_id": np.arange(n, dtype=np.int64),
              "group_id": np.zeros(n, np.int64), "policy": (np.arange(n) % 2).astype(np.uint8),
              "worker": np.full(n, b"w1", "S64"), "length": np.full(n, tokens, np.int32),
              "reward": rng.random(n).astype(np.float32), "guided": (np.arange(n) == 2).astype(np.uint8),
              "weight": np.ones(n, np.float32),
              "gen_s": np.zeros(n, np.float32), "t_commit": np.full(n, 1.0), "version_min": np.zeros(n, np.int32),
              "version_max": np.ones(n, np.int32), "version_at_commit": np.ones(n, np.int32)},
        meta=[json.dumps({"i": first_id + i}).encode() for i in range(n)])


def trained_run_dir(tmp_path: Path, killed: bool = False, steps: int = 2) -> Path:
    """A run directory written by the dataflow rank's state machine: eight tasks committed,
    `steps` trainer steps of 16 samples consumed, everything flushed. With `killed`, its shard
    is as a killed rank leaves it (copied while still open for writing, SWMR flags set)."""
    from astraflow.bench.payload import random_trajectory
    from astraflow.dataflow.state import DataflowState
    from astraflow.store.writer import list_shards

    run = make_run(tmp_path, ["tasks.group_size=4"])
    state = DataflowState(run.path, run.config, clock=lambda: 1000.0)
    state.recover()
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["policy"], 8)).worker_id
    rng = np.random.default_rng(0)
    for task in state.handle(m.Lease(worker, 8)).tasks:
        trajs = [random_trajectory(rng, "policy", 8, prompt_tokens=2, reward=float(i % 2), group_id=task.task_id)
                 for i in range(4)]
        state.handle(m.Commit(worker, task.task_id, m.TrajectoryBatch.from_trajectories(trajs)))
    for step in range(1, steps + 1):
        ids = state.handle(m.Batch("policy", step, 16, 0, 1, step - 1)).sample_ids.tolist()
        state.handle(m.Published("policy", step, f"file:///x/v{step}", []))
        state.handle(m.Consumed("policy", step, ids))
    state.flush()
    (shard,) = list_shards(run.path / "shards")
    open_copy = shard.read_bytes()
    state.close()
    if killed:
        shard.write_bytes(open_copy)
    return run.path


# (prompt, completion, reward) of `text_run_dir`
EPISODES = [("Anna has 12 pencils. How many? ", "\\boxed{7}", 1.0), ("She gives 5 to Tom. ", "\\boxed{5}", 0.0)]


def text_run_dir(tmp_path: Path) -> Path:
    """A run of two stored episodes whose model directory (a char tokenizer) encoded their
    tokens: prompt and completion decode back to `EPISODES`."""
    from astraflow.models.factory import make_model
    from astraflow.models.tokenizer import load_hf_tokenizer
    from astraflow.store.shards import ShardStore
    from astraflow.store.writer import StoreOptions

    run = make_run(tmp_path)
    tok = load_hf_tokenizer(make_model("qwen2.5", "tiny", run.path / "model", tokenizer="char",
                                       corpus=[p + c for p, c, _ in EPISODES] * 10))
    prompts = [tok.encode(p, add_special_tokens=False) for p, _, _ in EPISODES]
    answers = [tok.encode(c, add_special_tokens=False) for _, c, _ in EPISODES]
    tokens = np.concatenate([p + a for p, a in zip(prompts, answers)]).astype(np.int32)
    mask = np.concatenate([[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)]).astype(np.uint8)
    n = len(EPISODES)
    rows = {"sample_id": np.arange(n), "task_id": np.arange(n), "episode_id": np.arange(n), "group_id": np.arange(n),
            "policy": np.zeros(n, np.uint8),
            "worker": np.array([b"w<0>&"] * n, "S64"),  # markup: a report must escape it
            "length": np.array([len(p) + len(a) for p, a in zip(prompts, answers)], np.int32),
            "reward": np.array([r for _, _, r in EPISODES], np.float32), "guided": np.zeros(n, np.uint8),
            "weight": np.ones(n, np.float32), "gen_s": np.full(n, 0.5, np.float32), "t_commit": np.full(n, 1e9),
            "version_min": np.zeros(n, np.int32), "version_max": np.zeros(n, np.int32),
            "version_at_commit": np.full(n, -1, np.int32)}
    data = {"tokens": tokens, "logprobs": np.zeros(len(tokens), np.float32), "loss_mask": mask,
            "versions": np.where(mask == 1, 0, -1).astype(np.int32), "token_policy": (mask.astype(np.int8) - 1)}
    store = ShardStore(run.path / "shards", ("policy",), StoreOptions())
    store.append(RowBatch(data, rows, [json.dumps({"answer": c}).encode() for _, c, _ in EPISODES]))
    store.close()
    return run.path


@pytest.fixture
def trained_run(tmp_path: Path) -> Path:
    return trained_run_dir(tmp_path)


def store_sample(buf, sid: int, task: int = 0, version: int = 0, filtered: bool = False, reward: float = 0.0,
                 guided: bool = False, weight: float = 1.0, payload: object | None = None) -> None:
    """One sample into a buffer as the rank's commit path stores it: its columns in the table,
    then `add` (dataflow/buffers.py)."""
    ids = np.array([sid], np.int64)
    buf.samples.put(ids, policy=buf.index, state=0, task_id=task, version_min=version, advantage=0.0,
                    group_mean=0.0, group_std=1.0, shard=0, row=sid, tokens=1)
    buf.add(ids, filtered, np.array([reward]), np.array([guided]), weight, None if payload is None else [payload])
