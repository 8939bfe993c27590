"""The dataflow rank's state machine, driven directly with a controllable clock."""
from __future__ import annotations

import dataclasses
import json
import shutil
import time

import h5py
import numpy as np
import pytest

from astraflow.bench.payload import random_trajectory
from astraflow.dataflow import space
from astraflow.dataflow.state import DataflowState
from astraflow.dataflow.workers import FORGET_AFTER_S
from astraflow.launch import components
from astraflow.protocol import messages as m
from astraflow.store.journal import replay
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


def register(state: DataflowState, base: str = "w", capacity: int = 2) -> str:
    return state.handle(m.Register(m.PROTOCOL_VERSION, base, ["policy"], capacity, partition="cpu")).worker_id


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
    w = register(state, capacity=8)
    state.buffers["policy"].capacity = 10
    got = state.handle(m.Lease(w, 5))
    assert len(got.tasks) == 2 and got.reason == "backpressure"  # 2 tasks x 4 samples fit in 10
    publish(state, 5)
    stale = state.handle(m.Lease(w, 1, versions={"policy": 2}))
    assert stale.tasks == [] and stale.reason == "stale_weights"


def test_staleness_bound_at_consumption_counts_drops(env):
    run, state, clock = env
    w = register(state)
    t1, t2 = state.handle(m.Lease(w, 2)).tasks
    publish(state, 4)
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
    w = register(state, capacity=3)
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


@pytest.mark.parametrize("flushed", [True, False])
def test_payloads_beyond_the_memory_budget_are_served_from_their_shard(tmp_path, flushed):
    """Unflushed: a batch taken before the turn's flush (a parked request retried right after
    the commits). Its uncached rows were staged, not yet in the shard, and reading them back
    once marked the active shard damaged, which would have quarantined it."""
    run = make_run(tmp_path, ["tasks.group_size=4", "dataflow.payload_cache_mb=0.0005"])  # ~37 tokens
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    w = register(state)
    sent = {}
    for task in state.handle(m.Lease(w, 2)).tasks:
        batch = group(task.task_id, [0, 1, 0, 1], tokens=12)
        sids = state.handle(m.Commit(w, task.task_id, batch)).sample_ids
        sent.update({sid: batch.trajectory(i) for i, sid in enumerate(sids)})
    buf = state.buffers["policy"]
    assert buf.cached_tokens <= 4 * 12 and state.counters["payload_not_cached"] > 0  # the first commit only
    if flushed:
        state.flush()
    reply = state.handle(m.Batch("policy", 1, 8, 0, 1, 0))
    assert sorted(reply.sample_ids.tolist()) == sorted(sent)
    for i, sid in enumerate(reply.sample_ids.tolist()):  # the uncached ones came back from the shard, intact
        assert reply.trajectories.trajectory(i).tokens.tolist() == sent[sid].tokens.tolist()
    state.close()
    assert not [ev for ev in replay(run.path / "journal") if ev["ev"] == "damaged"]


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
    publish(state, 3)
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
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))  # its requeued successor
    assert not components.trainers_stopped(run, status())


def altered(batch: m.TrajectoryBatch, **columns) -> m.TrajectoryBatch:
    """`batch` with some columns replaced (a worker's bug or an insider's forgery)."""
    return m.TrajectoryBatch(**{**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}, **columns})


def test_commit_content_is_checked_before_anything_is_stored(env):
    """Out-of-vocabulary ids, NaN/Inf rewards and logprobs, impossible versions, a loss mask
    of 255, over-long trajectories and oversized commits are refused, naming the field; the
    vocabulary is read from the model's config.json when the first commit arrives (the model
    is prepared while the rank starts), and the run carries on with good commits."""
    run, state, clock = env
    model = run.path / "model"  # base_model_dir: no model.path configured
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 320, "max_position_embeddings": 512}))
    w = register(state)
    (task,) = state.handle(m.Lease(w, 1)).tasks
    tid = task.task_id
    good = m.TrajectoryBatch.from_trajectories(
        [dataclasses.replace(t, tokens=t.tokens % 320) for t in (group(tid, [0, 1, 0, 1]).trajectory(i) for i in range(4))])
    big = np.array(good.tokens)
    big[5] = 10**9
    nan_reward = np.array(good.reward)
    nan_reward[2] = np.nan
    inf_logprob, positive_logprob = np.array(good.logprobs), np.array(good.logprobs)
    inf_logprob[7] = -np.inf
    positive_logprob[good.offsets[1] + 6] = 0.5  # a trained token (the first 4 are the prompt)
    mask = np.array(good.loss_mask)
    mask[9] = 255
    versions = np.array(good.versions)
    versions[8] = 2**31 - 1
    long = m.TrajectoryBatch.from_trajectories([dataclasses.replace(
        good.trajectory(0), **{c: np.resize(getattr(good.trajectory(0), c), 1 << 20) for c in m.TOKEN_FIELDS})])
    many = m.TrajectoryBatch.from_trajectories([good.trajectory(0)] * 100_000)
    bad = {"trajectories.tokens": altered(good, tokens=big), "trajectories.reward": altered(good, reward=nan_reward),
           "trajectories.logprobs": altered(good, logprobs=inf_logprob),
           "trajectories.loss_mask": altered(good, loss_mask=mask),
           "trajectories.versions": altered(good, versions=versions),
           "trajectories.lengths": long, "trajectories": many}
    for field, batch in bad.items():
        err = state.handle(m.Commit(w, tid, batch))
        assert isinstance(err, m.Error) and err.code == "invalid_commit", (field, err)
        assert f"{field}: " in err.message, (field, err.message)
        assert state.counters[f"invalid_{field}"] == 1
    err = state.handle(m.Commit(w, tid, altered(good, logprobs=positive_logprob)))
    assert "trajectories.logprobs: trajectory 1, token 6: logprob 0.5 > 0 on a trained token" in err.message
    assert "vocabulary [0, 320)" in state.handle(m.Commit(w, tid, altered(good, tokens=big))).message
    assert state.handle(m.Commit(w, tid, good, versions={"policy": 2**31 - 1})).message.startswith(
        f"commit of task {tid} refused, nothing stored: versions.policy: version 2147483647; expected -1 .. 0")
    assert state.counters["error_invalid_commit"] == len(bad) + 3
    assert state.next_sample_id == 0 and state.buffers["policy"].counts["stored"] == 0  # nothing half-stored
    publish(state, 3)
    newer = np.where(good.versions >= 0, 3, -1).astype(np.int32)
    assert state.handle(m.Commit(w, tid, altered(good, versions=newer))).status == "stored"  # the run goes on
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    served = state.handle(m.Batch("policy", 1, 4, version=3)).trajectories
    assert int(served.tokens.max()) < 320 and np.isfinite(served.reward).all()


def test_the_vocabulary_is_looked_for_until_the_model_is_there(env):
    """Before the model exists, ids are only checked to be >= 0; the config.json that appears
    later (prepared in parallel) is read at a later commit and kept."""
    run, state, clock = env
    w = register(state)
    t1, t2 = state.handle(m.Lease(w, 2)).tasks
    assert state.handle(m.Commit(w, t1.task_id, group(t1.task_id, [0, 1, 0, 1]))).status == "stored"
    (run.path / "model").mkdir()
    (run.path / "model" / "config.json").write_text(json.dumps({"vocab_size": 320}))
    clock.t += 2
    err = state.handle(m.Commit(w, t2.task_id, group(t2.task_id, [0, 1, 0, 1])))  # random ids up to 2**31
    assert err.code == "invalid_commit" and "vocabulary [0, 320)" in err.message
    (run.path / "model" / "config.json").unlink()
    assert state.vocabulary.get(clock.t + 10) == 320  # kept


def test_only_the_lease_holder_commits(env):
    """A worker id that never registered, or another registered worker, cannot commit a task
    leased to someone else (the holder would then get `duplicate`); a late commit from the
    previous holder is accepted while nobody else holds the task, and refused once it does."""
    run, state, clock = env
    a, b = register(state, "a"), register(state, "b")
    t1, t2 = state.handle(m.Lease(a, 2)).tasks
    for intruder, code in (("ghost.r0", "unknown_worker"), (b, "not_holder")):
        err = state.handle(m.Commit(intruder, t1.task_id, group(t1.task_id, [1, 1, 1, 0])))
        assert isinstance(err, m.Error) and err.code == code, (intruder, err)
    assert state.counters["error_not_holder"] == 1 and state.next_sample_id == 0
    assert state.handle(m.Commit(a, t1.task_id, group(t1.task_id, [0, 1, 0, 1]))).status == "stored"
    clock.t += 11  # a's lease on t2 expires; nobody holds t2 yet
    state.tick()
    assert state.handle(m.Commit(a, t2.task_id, group(t2.task_id, [0, 1, 0, 1]))).status == "stored"
    (t3,) = state.handle(m.Lease(a, 1)).tasks
    clock.t += 11
    state.tick()
    assert state.handle(m.Lease(b, 1)).tasks[0].task_id == t3.task_id  # re-handed to b
    assert state.handle(m.Commit(a, t3.task_id, group(t3.task_id, [0, 1, 0, 1]))).code == "not_holder"
    assert state.handle(m.Commit(b, t3.task_id, group(t3.task_id, [0, 1, 0, 1]))).status == "stored"
    assert state.buffers["policy"].counts["stored"] == 12


def publish(state: DataflowState, upto: int, policy: str = "policy") -> None:
    """Versions 1..upto, in order, as a trainer publishes them."""
    for v in range(1, upto + 1):
        assert state.handle(m.Published(policy, v, f"file:///nowhere/v{v}", [])) == m.Ok()


def test_counts_steps_and_versions_are_bounded_by_what_the_rank_knows(env):
    """`Consumed` for a step never served marked the trainer finished for good (and was
    journalled); `Lease(n=2**62)` never returned; `Batch(version=2**62)` dropped the whole
    buffer as stale; `Batch(n=1e6)` parked forever. Each is bounded now, and refused with the
    field named, and nothing changes."""
    run, state, clock = env
    w = register(state)
    for t in state.handle(m.Lease(w, 2)).tasks:
        state.handle(m.Commit(w, t.task_id, group(t.task_id, [0, 1, 0, 1])))
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    buf = state.buffers["policy"]
    refused = {
        "never served": m.Consumed("policy", 10**9, []),
        "consumed: other ids": m.Consumed("policy", 1, [0, 1]),
        "batch version": m.Batch("policy", 1, 4, version=2**62),
        "batch n": m.Batch("policy", 1, 10**6),
        "batch world": m.Batch("policy", 1, 4, rank=999_999, world=10**6),
        "batch step": m.Batch("policy", 10**9, 4),
        "resume step": m.Ready(m.PROTOCOL_VERSION, "policy", 10**9),
        "published version": m.Published("policy", 2**62, "file:///nowhere/huge", []),
        "capacity": m.Register(m.PROTOCOL_VERSION, "greedy", ["policy"], 2**62),
        "lease versions": m.Lease(w, 1, {"policy": 2**62}),
        "heartbeat versions": m.Heartbeat(w, {"ghost": 0}),
    }
    for name, request in refused.items():
        err = state.handle(request)
        assert isinstance(err, m.Error) and err.code in ("bad_request", "conflict"), (name, err)
    assert not buf.finished and buf.trainer_step == 0 and not buf.consumed
    assert buf.counts["dropped_stale"] == 0 and buf.buffered == 8 and state.weights.latest("policy")[0] == -1
    reply = state.handle(m.Lease(w, 2**62))  # at most the worker's registered capacity (2)
    assert len(reply.tasks) == 2
    ids = state.handle(m.Batch("policy", 1, 4)).sample_ids.tolist()
    assert "was served 4 other samples" in state.handle(m.Consumed("policy", 1, ids[:3])).message
    assert state.handle(m.Consumed("policy", 1, ids)) == m.Ok()
    publish(state, 1)
    assert state.handle(m.Batch("policy", 2, 4, version=1)) is not None  # the next step, the newest version


def test_the_served_ledger_survives_a_restart(tmp_path):
    """A step served before the rank restarted stays served (journalled): the trainer's
    `Consumed` for it is accepted with exactly the served ids, its samples are not served to
    another step meanwhile, and a `Consumed` for a step never served is refused."""
    run = make_run(tmp_path, ["tasks.group_size=4"])
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    w = register(state, capacity=3)
    for t in state.handle(m.Lease(w, 3)).tasks:
        state.handle(m.Commit(w, t.task_id, group(t.task_id, [0, 1, 0, 1])))
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    ids = state.handle(m.Batch("policy", 1, 4)).sample_ids.tolist()
    state.flush()
    state.close()
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    buf = state.buffers["policy"]
    assert buf.buffered == 8 and list(buf.served) == [1] and buf.served[1].tolist() == ids
    others = list(buf.ready)[:4]
    assert state.handle(m.Consumed("policy", 2, others)).code == "conflict"  # never served
    assert state.handle(m.Batch("policy", 1, 4)).sample_ids.tolist() == ids  # a retried request
    assert state.handle(m.Consumed("policy", 1, ids)) == m.Ok()
    assert sorted(state.handle(m.Batch("policy", 2, 8)).sample_ids.tolist()) == sorted(buf.served[2])
    assert not set(buf.served[2]) & set(ids)
    state.close()


def test_reading_back_a_batch_costs_a_few_reads_however_many_samples_it_holds(tmp_path, monkeypatch):
    """Samples past `payload_cache_mb` were read back one row at a time (seven HDF5 reads
    each: a batch of 256 took a second inside the rank's one thread); now a batch of nearby
    rows costs one read per dataset, and every sample still comes back as it was sent."""
    run = make_run(tmp_path, ["tasks.group_size=4", "dataflow.payload_cache_mb=0", "policies.0.buffer_capacity=1024"])
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    w = register(state, capacity=64)
    sent = {}
    for task in state.handle(m.Lease(w, 64)).tasks:
        batch = group(task.task_id, [0, 1, 0, 1], tokens=12)
        sids = state.handle(m.Commit(w, task.task_id, batch)).sample_ids
        sent.update({sid: batch.trajectory(i) for i, sid in enumerate(sids)})
    state.flush()
    assert state.counters["payload_not_cached"] == 256
    reads = []
    real = h5py.Dataset.__getitem__
    monkeypatch.setattr(h5py.Dataset, "__getitem__", lambda ds, key: reads.append(ds.name) or real(ds, key))

    def serve(step: int, n: int) -> int:
        reads.clear()
        reply = state.handle(m.Batch("policy", step, n, 0, 1, 0))
        for i, sid in enumerate(reply.sample_ids.tolist()):
            got, want = reply.trajectories.trajectory(i), sent[sid]
            assert got.tokens.tolist() == want.tokens.tolist() and got.meta == want.meta
        state.handle(m.Consumed("policy", step, reply.sample_ids.tolist()))
        return len(reads)

    few, many = serve(1, 8), serve(2, 248)
    assert many == few <= 8, f"{few} reads for 8 samples, {many} for 248"
    state.close()


@pytest.mark.parametrize("plenty", [True, False], ids=["plenty of room", "close to full"])
def test_free_space_is_measured_once_a_second_while_there_is_plenty(env, monkeypatch, plenty):
    """statfs asks every storage target of a parallel filesystem, and the rank called it at
    every flush (hundreds a second under load); close to full it still measures every time."""
    run, state, clock = env
    if not plenty:
        monkeypatch.setattr(space, "HEADROOM", 1 << 62)
    calls = []
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: calls.append(path) or real(path))
    w = register(state, capacity=300)
    for task in state.handle(m.Lease(w, 300)).tasks:  # 300 flushes in 3 s, each with a commit
        clock.t += 0.01
        state.handle(m.Commit(w, task.task_id, group(task.task_id, [0, 1, 0, 1])))
        state.flush()
    if plenty:
        assert 2 <= len(calls) <= 3  # one a second
    else:
        assert len(calls) == 300
    assert state.handle(m.Status()).status["store"]["free_space_checks"] == len(calls) + 1  # + recovery's flush


def test_registration_cost_does_not_grow_with_the_workers_registered(tmp_path):
    """Each registration looked through every incarnation ever registered (10,000 ids took
    68 s through the protocol): with 30,000 registered, one costs what it costs with none."""
    def new_state(name: str) -> DataflowState:
        (tmp_path / name).mkdir()
        run = make_run(tmp_path / name)
        state = DataflowState(run.path, run.config, clock=Clock())
        state.recover()
        return state

    def cost(state: DataflowState) -> float:
        best = float("inf")
        for rep in range(3):
            t0 = time.perf_counter()
            for i in range(200):
                register(state, f"new-{rep}-{i}")
            best = min(best, time.perf_counter() - t0)
        return best

    empty, full = new_state("empty"), new_state("full")
    for i in range(30_000):
        full.workers.register(f"old-{i}", 0.0, policies=("policy",), capacity=1, hardware="", partition="", host="")
    assert cost(full) < 4 * cost(empty)
    empty.close()
    full.close()


def test_dead_workers_are_forgotten_after_a_grace_period_but_their_restart_counters_are_kept(env):
    run, state, clock = env
    for i in range(1000):
        register(state, f"w{i}")
    register(state, "w0")  # w0.r0 is replaced by w0.r1
    clock.t += 31  # silent past the heartbeat timeout: all dead
    state.tick()
    status = state.handle(m.Status()).status["workers"]
    assert (status["alive"], status["dead"]) == (0, 1001)  # listed for a while
    clock.t += FORGET_AFTER_S
    state.tick()
    assert not state.workers.workers and state.handle(m.Status()).status["workers"]["dead"] == 0
    assert register(state, "w0") == "w0.r2" and register(state, "w7") == "w7.r1"


def test_an_unreadable_model_config_does_not_stop_commits(env, caplog):
    run, state, clock = env
    (run.path / "model").mkdir()
    (run.path / "model" / "config.json").write_text("[1, 2]")  # JSON, but not a model's config
    w = register(state)
    for _ in range(3):
        (task,) = state.handle(m.Lease(w, 1)).tasks
        assert state.handle(m.Commit(w, task.task_id, group(task.task_id, [0, 1, 0, 1]))).status == "stored"
        clock.t += 2
    assert state.vocabulary.size is None
    assert [r.getMessage() for r in caplog.records].count(
        f"{run.path / 'model' / 'config.json'}: no positive integer vocab_size; until it is readable, token ids "
        f"are only checked to be >= 0") == 1


def test_the_ranks_of_a_model_replica_are_served_the_same_rows(tmp_path):
    """With tp x pp > 1 every rank of a model replica asks for its replica's share
    (`Batch(rank = data-parallel rank, world = replicas, member)`): the two members of a
    replica get the same rows, the two replicas disjoint halves of the step; the generated
    reward goes to one request of the step however the members' requests arrive; a member or
    a data-parallel world beyond the layout is refused."""
    run = make_run(tmp_path, ["tasks.group_size=4", "trainer.backend=megatron", "trainer.world=4", "trainer.tp=2"])
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    w = register(state)
    for t in state.handle(m.Lease(w, 2)).tasks:
        state.handle(m.Commit(w, t.task_id, group(t.task_id, [0, 1, 0, 1])))
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0, world=4))
    # member 1 of replica 0 asks first
    served = {(rank, member): state.handle(m.Batch("policy", 1, 8, rank, 2, 0, member))
              for rank, member in ((0, 1), (1, 1), (0, 0), (1, 0))}
    ids = {k: r.sample_ids.tolist() for k, r in served.items()}
    assert ids[0, 0] == ids[0, 1] and ids[1, 0] == ids[1, 1] and len(ids[0, 0]) == len(ids[1, 0]) == 4
    assert len(set(ids[0, 0]) | set(ids[1, 0])) == 8
    assert {k: r.generated_count for k, r in served.items()} == {(0, 1): 0, (1, 1): 0, (0, 0): 8, (1, 0): 0}
    for bad in (m.Batch("policy", 1, 8, 0, 2, 0, member=2), m.Batch("policy", 1, 8, 3, 4, 0)):
        assert state.handle(bad).code == "bad_request"
    step = [i for pair in zip(ids[0, 0], ids[1, 0]) for i in pair]  # dealt rank::world: interleaved back
    assert state.handle(m.Consumed("policy", 1, step)) == m.Ok()
    state.close()
