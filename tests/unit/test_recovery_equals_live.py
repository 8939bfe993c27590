"""A restarted dataflow rank holds exactly what the live one held about every stored sample.

Recovery rebuilds the sample table from a few columns of the shards' row tables in whole-array
operations, a slice of whole tasks at a time (`recovery.Fold.fold_rows`), and the journal;
the live rank built it commit by commit. Two policies (one scaling advantages by the group's
std, one not), multi-policy commits, filtered groups, several shards, consumed steps and a
served step not yet acknowledged: every column of every sample, the buffers' counts and their
ready queues must come back equal, and a batch request for the served step gets the same
samples, advantages and trajectories as before the restart."""
from __future__ import annotations

import numpy as np

from astraflow.bench.payload import random_trajectory
from astraflow.dataflow import recovery
from astraflow.dataflow.samples import COLUMNS
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from tests.conftest import make_run

CONFIG = """
run: {name: recovery, seed: 0}
dataflow: {interface: loopback, lease_s: 30, heartbeat_timeout_s: 30}
store: {shard_max_mb: 0.01, chunk_tokens: 256}
tasks: {kind: arithmetic, seed: 0, heldout: 0, group_size: 4, workflow: solver_verifier}
policies:
  - {name: solver, role: solver, max_staleness: 100, buffer_capacity: 4096}
  - {name: verifier, role: verifier, max_staleness: 100, buffer_capacity: 4096, advantage_std: false}
"""


def commit(state: DataflowState, worker: str, task_id: int, rng: np.random.Generator) -> None:
    rewards = rng.integers(0, 2, 6).astype(float)
    if task_id % 5 == 0:
        rewards[:4] = 1.0  # the solver's group all right: filtered (no signal)
    trajs = [random_trajectory(rng, "solver" if i < 4 else "verifier", int(rng.integers(4, 20)), prompt_tokens=3,
                               reward=float(r), group_id=task_id) for i, r in enumerate(rewards)]
    reply = state.handle(m.Commit(worker, task_id, m.TrajectoryBatch.from_trajectories(trajs)))
    assert reply.status == "stored"
    state.flush()


def snapshot(state: DataflowState) -> dict:
    table = state.samples
    ids = np.flatnonzero(table.policy[: table.capacity] >= 0)
    return {"ids": ids.tolist(),
            "columns": {name: getattr(table, name)[ids].tolist() for name in COLUMNS},
            "buffers": {name: (dict(buf.counts), list(buf.ready), {s: v.tolist() for s, v in buf.served.items()},
                               {s: v.tolist() for s, v in buf.consumed.items()}, buf.trainer_step)
                        for name, buf in state.buffers.items()},
            "done": sorted(state.tasks.done)}


def test_a_restarted_rank_rebuilds_exactly_the_live_sample_table(tmp_path, monkeypatch):
    monkeypatch.setattr(recovery, "RECOVERY_SLICE_ROWS", 7)  # many slices, cut at task boundaries
    run = make_run(tmp_path, config=CONFIG)
    state = DataflowState(run.path, run.config)
    state.recover()
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["solver", "verifier"], 64)).worker_id
    rng = np.random.default_rng(0)
    for task in state.handle(m.Lease(worker, 40)).tasks:
        commit(state, worker, task.task_id, rng)
    for policy in ("solver", "verifier"):
        state.handle(m.Ready(m.PROTOCOL_VERSION, policy, 0))
        for step in (1, 2):
            batch = state.handle(m.Batch(policy, step, 16))
            state.handle(m.Consumed(policy, step, batch.sample_ids.tolist()))
    served = state.handle(m.Batch("solver", 3, 16))  # served, not acknowledged
    state.flush()
    live = snapshot(state)
    state.close()
    assert len(list((run.path / "shards").glob("*.h5"))) >= 3
    assert live["buffers"]["solver"][0]["filtered"] > 0 and live["buffers"]["verifier"][0]["consumed"] == 32

    restarted = DataflowState(run.path, run.config)
    restarted.recover()
    assert snapshot(restarted) == live
    again = restarted.handle(m.Batch("solver", 3, 16))
    assert again.sample_ids.tolist() == served.sample_ids.tolist() and not again.replay
    assert again.advantages.tolist() == served.advantages.tolist()
    assert again.group_std.tolist() == served.group_std.tolist()
    assert np.array_equal(again.trajectories.tokens, served.trajectories.tokens)
    restarted.close()
