"""The dataflow rank's state machine, driven directly with a controllable clock."""
from __future__ import annotations

import numpy as np
import pytest

from astraflow.bench.payload import random_trajectory
from astraflow.dataflow.state import DataflowState
from astraflow.launch import components
from astraflow.protocol import messages as m
from astraflow.store.reader import load_rows
from tests.conftest import make_run


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(tmp_path):
    run = make_run(tmp_path, ["dataflow.lease_s=10", "dataflow.heartbeat_timeout_s=30", "tasks.group_size=4"])
    clock = Clock()
    state = DataflowState(run.path, run.config, clock=clock)
    state.recover()
    yield run, state, clock
    state.close()


def group(task_id: int, rewards: list[float], version: int = 0, tokens: int = 12) -> m.TrajectoryBatch:
    rng = np.random.default_rng(task_id)
    return m.TrajectoryBatch.from_trajectories(
        [random_trajectory(rng, "policy", tokens, prompt_tokens=4, version=version, reward=r, group_id=task_id)
         for r in rewards])


def register(state: DataflowState, base: str = "w") -> str:
    return state.handle(m.Register(m.PROTOCOL_VERSION, base, ["policy"], 2, partition="cpu")).worker_id


def test_expired_lease_goes_to_another_worker_and_late_commit_is_a_duplicate(env):
    run, state, clock = env
    a, b = register(state, "a"), register(state, "b")
    (task,) = state.handle(m.Lease(a, 1)).tasks
    clock.t += 11
    state.tick()
    (again,) = state.handle(m.Lease(b, 1)).tasks
    assert again.task_id == task.task_id
    assert state.handle(m.Commit(b, task.task_id, group(task.task_id, [0, 1, 0, 1]))).status == "stored"
    assert state.handle(m.Commit(a, task.task_id, group(task.task_id, [1, 1, 0, 1]))).status == "duplicate"
    assert state.buffers["policy"].counts["stored"] == 4


def test_renewed_lease_does_not_expire(env):
    run, state, clock = env
    a, b = register(state, "a"), register(state, "b")
    (task,) = state.handle(m.Lease(a, 1)).tasks
    for _ in range(5):
        clock.t += 6
        assert state.handle(m.Renew(a, [task.task_id])).renewed == [task.task_id]
        state.tick()
    (other,) = state.handle(m.Lease(b, 1)).tasks
    assert other.task_id != task.task_id


def test_silent_worker_is_declared_dead_and_its_leases_return(tmp_path):
    run = make_run(tmp_path, ["dataflow.lease_s=1000", "dataflow.heartbeat_timeout_s=30"])
    clock = Clock()
    state = DataflowState(run.path, run.config, clock=clock)
    state.recover()
    a, b = register(state, "a"), register(state, "b")
    tasks = state.handle(m.Lease(a, 2)).tasks
    for _ in range(7):  # a stays silent for 35 s (timeout 30 s) while it keeps renewing nothing
        clock.t += 5
        state.handle(m.Heartbeat(b))
    state.tick()
    assert state.handle(m.Heartbeat(a)).code == "unknown_worker"
    got = state.handle(m.Lease(b, 2)).tasks
    assert sorted(t.task_id for t in got) == sorted(t.task_id for t in tasks)
    assert state.counters["workers_dead"] == 1 and "leases_expired" not in state.counters
    state.close()


def test_reregistration_is_a_new_incarnation_and_frees_old_leases(env):
    run, state, clock = env
    first = register(state, "slurm-77_3")
    (task,) = state.handle(m.Lease(first, 1)).tasks
    second = register(state, "slurm-77_3")
    assert (first, second) == ("slurm-77_3.r0", "slurm-77_3.r1")
    assert state.handle(m.Lease(second, 1)).tasks[0].task_id == task.task_id


def test_zero_advantage_groups_are_stored_but_not_served(env):
    run, state, clock = env
    w = register(state)
    t1, t2 = state.handle(m.Lease(w, 2)).tasks
    state.handle(m.Commit(w, t1.task_id, group(t1.task_id, [1, 1, 1, 1])))
    state.handle(m.Commit(w, t2.task_id, group(t2.task_id, [0, 1, 1, 0])))
    counts = state.buffers["policy"].counts
    assert counts["stored"] == 8 and counts["filtered"] == 4 and state.buffers["policy"].buffered == 4
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    reply = state.handle(m.Batch("policy", 1, 4))
    assert set(reply.task_ids) == {t2.task_id}
    np.testing.assert_allclose(reply.advantages, [-1, 1, 1, -1], atol=1e-4)
    assert reply.group_mean[0] == pytest.approx(0.5)


def test_a_guided_record_is_trained_but_not_counted_as_generated(tmp_path):
    """A reference answer appended to an all-wrong group (meta `guided`) makes the group
    servable, stands in the shard's `guided` column, stays out of the generated reward and
    count, and is counted as guided again after a restart."""
    run = make_run(tmp_path, ["tasks.group_size=4"])
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    w = register(state)
    task = state.handle(m.Lease(w, 1)).tasks[0]
    rng = np.random.default_rng(0)
    trajs = [random_trajectory(rng, "policy", 12, prompt_tokens=4, reward=r, group_id=task.task_id)
             for r in (0, 0, 0, 0, 1)]
    trajs[-1].meta["guided"] = True
    state.handle(m.Commit(w, task.task_id, m.TrajectoryBatch.from_trajectories(trajs)))
    counts = state.buffers["policy"].counts
    assert counts["stored"] == 5 and counts["guided"] == 1 and counts["filtered"] == 0
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    reply = state.handle(m.Batch("policy", 1, 5))
    assert reply.generated_count == 4 and reply.generated_reward_mean == 0.0
    np.testing.assert_allclose(sorted(reply.advantages), [-0.5] * 4 + [2.0], atol=1e-4)
    state.flush()
    state.close()
    assert load_rows(run.path)["guided"].tolist() == [0, 0, 0, 0, 1]
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    assert state.buffers["policy"].counts["guided"] == 1
    state.close()


def test_backpressure_and_stale_weights_stop_leases(env):
    run, state, clock = env
    w = register(state)
    state.buffers["policy"].capacity = 10
    got = state.handle(m.Lease(w, 5))
    assert len(got.tasks) == 2 and got.reason == "backpressure"  # 2 tasks x 4 samples fit in 10
    state.handle(m.Published("policy", 5, "file:///nowhere/v5", []))
    stale = state.handle(m.Lease(w, 1, versions={"policy": 2}))
    assert stale.tasks == [] and stale.reason == "stale_weights"


def test_staleness_bound_at_consumption_counts_drops(env):
    run, state, clock = env
    w = register(state)
    t1, t2 = state.handle(m.Lease(w, 2)).tasks
    state.handle(m.Commit(w, t1.task_id, group(t1.task_id, [0, 1, 0, 1], version=0)))
    state.handle(m.Commit(w, t2.task_id, group(t2.task_id, [0, 1, 0, 1], version=3)))
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    reply = state.handle(m.Batch("policy", 1, 4, version=4))  # max_staleness 2: version 0 is too old
    assert set(reply.task_ids) == {t2.task_id} and state.buffers["policy"].counts["dropped_stale"] == 4


def test_protocol_version_mismatch_is_refused(env):
    run, state, clock = env
    err = state.handle(m.Register(m.PROTOCOL_VERSION + 1, "w", ["policy"], 1))
    assert isinstance(err, m.Error) and err.code == "version_mismatch" and "speaks protocol" in err.message
    err = state.handle(m.Ready(0, "policy", 0))
    assert err.code == "version_mismatch"


def test_bad_commits_are_refused_with_the_reason(env):
    run, state, clock = env
    w = register(state)
    assert state.handle(m.Commit(w, 99, group(99, [0, 1]))).code == "bad_request"  # never handed out
    (task,) = state.handle(m.Lease(w, 1)).tasks
    wrong = group(task.task_id, [0, 1])
    wrong = m.TrajectoryBatch(**{**wrong.__dict__, "policy": ["ghost", "ghost"]})
    assert "unknown policies ['ghost']" in state.handle(m.Commit(w, task.task_id, wrong)).message
    assert state.next_sample_id == 0  # nothing half-stored


def test_weight_retention_keeps_last_k_and_pinned(env):
    run, state, clock = env
    wdir = run.path / "weights" / "policy"
    for v in range(6):
        (wdir / f"v{v}").mkdir(parents=True)
        state.handle(m.Published("policy", v, f"file://{wdir}/v{v}", pinned=[1]))
    state.weights.deleter.wait()
    assert sorted(p.name for p in wdir.iterdir()) == ["v1", "v3", "v4", "v5"]  # keep_versions=3, v1 pinned
    assert state.handle(m.Weights("policy")) == m.WeightsReply(5, f"file://{wdir}/v5")


def test_weight_retention_keeps_what_kept_deltas_are_read_on_and_replaced_versions_for_a_while(env):
    """A kept delta version keeps its base, transitively: the newest full version and every
    delta after it survive however far back the full version is. A version published again
    (a replayed step) leaves its first directory in place until it falls below the kept ones."""
    run, state, clock = env
    wdir = run.path / "weights" / "policy"

    def publish(name: str, version: int, base: str = "") -> None:
        (wdir / name).mkdir(parents=True)
        state.handle(m.Published("policy", version, f"file://{wdir}/{name}", full=not base,
                                 base=f"file://{wdir}/{base}" if base else ""))

    publish("v1", 1)
    for v in range(2, 8):
        publish(f"v{v}", v, base=f"v{v - 1}")
    state.weights.deleter.wait()
    assert sorted(p.name for p in wdir.iterdir()) == [f"v{v}" for v in range(1, 8)]  # v7's chain reaches v1
    for name, v, base in (("v8", 8, ""), ("v9", 9, "v8"), ("v10", 10, "v9")):
        publish(name, v, base)
    state.weights.deleter.wait()
    assert sorted(p.name for p in wdir.iterdir()) == ["v10", "v8", "v9"]
    publish("v10-1", 10)  # step 10 replayed by a restarted trainer: a full version of its own
    publish("v11", 11, base="v10-1")
    state.weights.deleter.wait()
    assert sorted(p.name for p in wdir.iterdir()) == ["v10", "v10-1", "v11", "v8", "v9"]
    assert state.handle(m.Weights("policy")) == m.WeightsReply(11, f"file://{wdir}/v11")
    for v in (12, 13, 14):
        publish(f"v{v}", v)
    state.weights.deleter.wait()
    assert sorted(p.name for p in wdir.iterdir()) == ["v12", "v13", "v14"]


def test_status_schema(env):
    run, state, clock = env
    w = register(state)
    (task,) = state.handle(m.Lease(w, 1)).tasks
    state.handle(m.Commit(w, task.task_id, group(task.task_id, [0, 1, 0, 1])))
    s = state.handle(m.Status()).status
    assert s["schema_version"] == 1
    assert s["workers"]["by_partition"] == {"cpu": 1} and s["tasks"]["done"] == 1
    assert s["policies"]["policy"]["stored"] == 4 and 0.0 <= s["policies"]["policy"]["trainer_wait_fraction"] <= 1.0
    assert s["throughput"]["per_partition"]["cpu"]["trajectories_per_s"] > 0


def test_quarantined_shard_tasks_are_handed_out_again(tmp_path):
    run = make_run(tmp_path, ["tasks.group_size=2", "store.shard_max_mb=0.0001"])  # one shard per flush
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    w = register(state)
    tasks = state.handle(m.Lease(w, 3)).tasks
    for t in tasks:
        state.handle(m.Commit(w, t.task_id, group(t.task_id, [0, 1])))
        state.flush()
    state.close()
    shards = sorted((run.path / "shards").glob("shard-*.h5"))
    assert len(shards) == 3
    shards[1].write_bytes(shards[1].read_bytes()[:2000])  # truncate the second commit's shard
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    status = state.handle(m.Status()).status
    assert len(status["store"]["quarantined"]) == 1 and "truncated" in status["store"]["quarantined"][0]
    assert status["policies"]["policy"]["stored"] == 4
    w = register(state)
    again = [t.task_id for t in state.handle(m.Lease(w, 1)).tasks]
    assert again == [tasks[1].task_id]  # the lost commit's task comes back first
    state.close()


def test_drained_worker_is_told_to_retire_and_leaving_hands_everything_back(env):
    run, state, clock = env
    a, b = register(state, "a"), register(state, "b")
    held = [t.task_id for t in state.handle(m.Lease(a, 2)).tasks]
    state.handle(m.Drain(["a"]))
    reply = state.handle(m.Lease(a, 2))
    assert (reply.tasks, reply.reason) == ([], "retire")
    assert state.handle(m.Lease(b, 1)).tasks  # others are unaffected
    # leaving without naming its leases still hands them all back, and at once
    state.handle(m.Release(a, [], leaving=True))
    worker = state.workers.workers[a]
    assert not worker.alive and not any(lease.worker == a for lease in state.tasks.leased.values())
    assert set(held) <= set(state.tasks.queued)
    listed = {w["base"]: w for w in state.handle(m.Status()).status["workers"]["list"]}
    assert listed["a"]["draining"] and not listed["b"]["draining"]


def test_payloads_beyond_the_memory_budget_are_served_from_their_shard(tmp_path):
    run = make_run(tmp_path, ["tasks.group_size=4", "dataflow.payload_cache_mb=0.0005"])  # ~37 tokens
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    w = register(state)
    sent = {}
    for task in state.handle(m.Lease(w, 2)).tasks:
        batch = group(task.task_id, [0, 1, 0, 1], tokens=12)
        sent[task.task_id] = batch
        state.handle(m.Commit(w, task.task_id, batch))
    buf = state.buffers["policy"]
    assert buf.cached_tokens <= 4 * 12 and state.counters["payload_not_cached"] > 0  # the first commit only
    state.flush()
    reply = state.handle(m.Batch("policy", 1, 8, 0, 1, 0))
    served = sorted(tuple(reply.trajectories.trajectory(i).tokens.tolist()) for i in range(8))
    expected = sorted(tuple(b.trajectory(i).tokens.tolist()) for b in sent.values() for i in range(4))
    assert served == expected  # the uncached ones came back from the shard, intact
    state.close()


def test_a_starving_trainer_gets_a_warning_that_says_its_groups_were_filtered(env, caplog):
    run, state, clock = env
    w = register(state)
    assert state.handle(m.Batch("policy", 1, 8, 0, 1, 0)) is None  # nothing ready: the trainer waits
    state.waits["policy"].start(clock.t)
    for _ in range(4):  # the policy answers every prompt alike: every group is filtered
        (task,) = state.handle(m.Lease(w, 1)).tasks
        assert state.handle(m.Commit(w, task.task_id, group(task.task_id, [1, 1, 1, 1]))).status == "stored"
        clock.t += 5
        state.tick()
    assert not caplog.records  # 20 s: not yet
    clock.t += 15
    state.tick()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "waited 35s" in warning and "16 samples were stored, 16 filtered" in warning


def test_lease_and_commit_replies_name_the_newest_weights(env):
    run, state, clock = env
    w = register(state)
    reply = state.handle(m.Lease(w, 1))
    assert reply.latest == {"policy": -1}  # nothing published yet
    state.handle(m.Published("policy", 3, "file:///nowhere/v3", []))
    (task,) = reply.tasks
    assert state.handle(m.Commit(w, task.task_id, group(task.task_id, [0, 1, 0, 1]))).latest == {"policy": 3}
    state.handle(m.Published("policy", 4, "file:///nowhere/v4", []))
    assert state.handle(m.Lease(w, 1, {"policy": 3})).latest == {"policy": 4}


def test_a_stopped_trainer_is_shown_until_it_is_ready_again(env):
    run, state, clock = env
    status = lambda: state.handle(m.Status()).status  # noqa: E731
    assert components.trainers_stopped(run, status())  # never ready: nothing to wait for
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    assert not components.trainers_stopped(run, status())  # ready: the launcher waits for it
    assert state.handle(m.Stopped("policy", 7)) == m.Ok()
    assert status()["policies"]["policy"]["trainer"]["stopped_step"] == 7
    assert components.trainers_stopped(run, status())
    assert state.handle(m.Stopped("nobody", 7)).code == "bad_request"
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 7))  # its requeued successor
    assert not components.trainers_stopped(run, status())
