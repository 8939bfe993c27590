"""Multi-policy scheduling in the dataflow rank's state: routing by hosted policies, per-policy
trainer settings, the version barrier and the sync schedule (a controllable clock)."""
from __future__ import annotations

import numpy as np
import pytest

from astraflow.bench.payload import random_trajectory
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from tests.conftest import make_run

CONFIG = """
run: {name: test, seed: 0}
dataflow: {interface: loopback, lease_s: 30, heartbeat_timeout_s: 30}
tasks: {kind: arithmetic, seed: 0, heldout: 200, group_size: 4, workflow: solver_verifier}
trainer: {steps: 5, batch_size: 8}
policies:
  - {name: solver, role: solver, max_staleness: 2}
  - {name: verifier, role: verifier, max_staleness: 2, batch_size: 4, lr: 0.01, ref_kl: 0.2}
"""


@pytest.fixture
def make_state(tmp_path):
    states = []

    def make(*extra: str) -> DataflowState:
        where = tmp_path / str(len(states))
        where.mkdir()
        run = make_run(where, list(extra), config=CONFIG)
        state = DataflowState(run.path, run.config, clock=lambda: 1000.0)
        state.recover()
        states.append(state)
        return state

    yield make
    for s in states:
        s.close()


def register(state: DataflowState, base: str, policies: list[str]) -> str:
    return state.handle(m.Register(m.PROTOCOL_VERSION, base, policies, 4)).worker_id


def commit(state: DataflowState, worker: str, task: m.Task, version: int = 0, solver_filtered: bool = False) -> None:
    """A group for both policies, rewards 0/1 alternating (no zero-advantage filtering), or
    with `solver_filtered` all 0 for the solver (a zero-advantage group: filtered)."""
    rng = np.random.default_rng(task.task_id)
    trajs = [random_trajectory(rng, p, 10, prompt_tokens=3, version=version,
                               reward=0.0 if solver_filtered and p == "solver" else float(i % 2),
                               group_id=task.task_id) for p in ("solver", "verifier") for i in range(4)]
    for t in trajs:  # token_policy of the generated part: the record's own policy
        t.token_policy[t.loss_mask == 1] = 0 if t.policy == "solver" else 1
    reply = state.handle(m.Commit(worker, task.task_id, m.TrajectoryBatch.from_trajectories(trajs),
                                  {"solver": version, "verifier": version}))
    assert reply.status == "stored"


def publish(state: DataflowState, policy: str, step: int) -> None:
    ids = state.buffers[policy].served[step]
    state.handle(m.Published(policy, step, f"file:///nowhere/{policy}/v{step}", []))
    state.handle(m.Consumed(policy, step, ids))


def test_config_gives_each_policy_its_own_trainer_settings(make_state):
    cfg = make_state().cfg
    assert (cfg.trainer_for("solver").batch_size, cfg.trainer_for("solver").lr) == (8, 1e-3)
    assert (cfg.trainer_for("verifier").batch_size, cfg.trainer_for("verifier").lr) == (4, 0.01)
    assert (cfg.trainer_for("solver").ref_kl, cfg.trainer_for("verifier").ref_kl) == (0.0, 0.2)
    assert cfg.task_policies == ("solver", "verifier")


def test_task_goes_only_to_a_worker_hosting_every_policy_it_needs(make_state):
    state = make_state()
    partial = register(state, "partial", ["solver"])
    full = register(state, "full", ["solver", "verifier"])
    refused = state.handle(m.Lease(partial, 2, {"solver": 0}))
    assert refused.tasks == [] and refused.reason == "no_matching_policies"
    tasks = state.handle(m.Lease(full, 2, {"solver": 0, "verifier": 0})).tasks
    assert len(tasks) == 2 and all(t.policies == ["solver", "verifier"] for t in tasks)


def test_policies_advance_independently_without_a_barrier(make_state):
    state = make_state()
    w = register(state, "w", ["solver", "verifier"])
    for task in state.handle(m.Lease(w, 4, {"solver": 0, "verifier": 0})).tasks:
        commit(state, w, task)
    # the verifier takes three steps (batch 4) while the solver has taken none
    for step in (1, 2, 3):
        assert state.handle(m.Batch("verifier", step, 4, 0, 1, step - 1)) is not None
        publish(state, "verifier", step)
    assert state.weights.latest("verifier")[0] == 3 and state.weights.latest("solver")[0] == -1


def test_barrier_holds_a_policy_until_the_other_has_published(make_state):
    state = make_state("schedule.barrier=true")
    w = register(state, "w", ["solver", "verifier"])
    for task in state.handle(m.Lease(w, 4, {"solver": 0, "verifier": 0})).tasks:
        commit(state, w, task)
    assert state.handle(m.Batch("verifier", 1, 4, 0, 1, 0)) is not None
    publish(state, "verifier", 1)
    assert state.handle(m.Batch("verifier", 2, 4, 0, 1, 1)) is None  # waits: solver has not done step 1
    assert state.handle(m.Batch("solver", 1, 8, 0, 1, 0)) is not None
    publish(state, "solver", 1)
    assert state.handle(m.Batch("verifier", 2, 4, 0, 1, 1)) is not None


def test_sync_schedule_generates_one_batch_then_waits_for_training_and_new_weights(make_state):
    state = make_state("schedule.mode=sync")
    w = register(state, "w", ["solver", "verifier"])
    v0 = {"solver": 0, "verifier": 0}
    (first,) = state.handle(m.Lease(w, 1, v0)).tasks
    commit(state, w, first)  # 4 samples each: the verifier's batch, half the solver's
    assert state.handle(m.Batch("verifier", 1, 4, 0, 1, 0)) is None  # the round is not complete
    tasks = state.handle(m.Lease(w, 16, v0)).tasks
    assert len(tasks) == 1  # only what the solver's batch still lacks (groups of 4)
    assert state.handle(m.Lease(w, 16, v0)).reason == "sync_full"  # in flight covers it
    commit(state, w, tasks[0])
    assert state.handle(m.Batch("solver", 1, 8, 0, 1, 0)) is not None
    assert state.handle(m.Lease(w, 16, v0)).reason == "sync_training"
    publish(state, "solver", 1)
    assert state.handle(m.Batch("verifier", 1, 4, 0, 1, 0)) is not None
    publish(state, "verifier", 1)
    assert state.handle(m.Lease(w, 16, v0)).reason == "stale_weights"  # the worker must reload first
    v1 = {"solver": 1, "verifier": 1}
    # the verifier's 4 unserved samples cover its next batch; the solver needs 8 more: 2 tasks
    assert len(state.handle(m.Lease(w, 16, v1)).tasks) == 2


def test_a_full_buffer_does_not_stall_a_sync_round_another_policy_is_short_of(make_state):
    state = make_state("schedule.mode=sync", "policies.1.buffer_capacity=8")
    w = register(state, "w", ["solver", "verifier"])
    v0 = {"solver": 0, "verifier": 0}
    for task in state.handle(m.Lease(w, 16, v0)).tasks:  # 2 tasks: what the solver's batch of 8 lacks
        commit(state, w, task, solver_filtered=True)  # ... but its groups are filtered
    assert state.buffers["verifier"].buffered == 8 and not state.buffers["verifier"].has_room(4)
    assert state.handle(m.Batch("verifier", 1, 4, 0, 1, 0)) is None  # the round waits for the solver
    tasks = state.handle(m.Lease(w, 16, v0)).tasks  # so the full verifier must not refuse these
    assert len(tasks) == 2
    for task in tasks:
        commit(state, w, task)
    assert state.handle(m.Batch("solver", 1, 8, 0, 1, 0)) is not None
    assert state.handle(m.Batch("verifier", 1, 4, 0, 1, 0)) is not None


def test_without_coupling_a_full_buffer_holds_generation_back(make_state):
    state = make_state("policies.1.buffer_capacity=8")
    w = register(state, "w", ["solver", "verifier"])
    v0 = {"solver": 0, "verifier": 0}
    for task in state.handle(m.Lease(w, 2, v0)).tasks:
        commit(state, w, task, solver_filtered=True)
    assert state.handle(m.Lease(w, 1, v0)).reason == "backpressure"  # the verifier trains on its own


def test_sync_round_waits_until_every_policy_has_finished_the_previous_one(make_state):
    state = make_state("schedule.mode=sync")
    w = register(state, "w", ["solver", "verifier"])
    for task in state.handle(m.Lease(w, 16, {"solver": 0, "verifier": 0})).tasks:
        commit(state, w, task)  # 8 samples each: the solver's batch, two of the verifier's
    assert state.handle(m.Batch("verifier", 1, 4, 0, 1, 0)) is not None
    publish(state, "verifier", 1)
    # the solver's step-1 batch is still in the buffer: it is not a batch for round 2
    assert state.handle(m.Batch("verifier", 2, 4, 0, 1, 1)) is None
    assert state.handle(m.Batch("solver", 1, 8, 0, 1, 0)) is not None
    publish(state, "solver", 1)
    assert state.handle(m.Batch("verifier", 2, 4, 0, 1, 1)) is None  # round 2 needs the solver's new batch
    v1 = {"solver": 1, "verifier": 1}
    for task in state.handle(m.Lease(w, 16, v1)).tasks:
        commit(state, w, task, version=1)
    assert state.handle(m.Batch("verifier", 2, 4, 0, 1, 1)) is not None
    assert state.handle(m.Batch("solver", 2, 8, 0, 1, 1)) is not None
