"""The dataflow rank as a real process, with real worker processes and trainer clients."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from astraflow.protocol import messages as m
from astraflow.protocol.codec import Codec, RemoteError
from astraflow.bench.payload import random_trajectory
from tests.conftest import REPO, DataflowProcess, client, make_run, register, trained_run_dir
from tests.integration.helpers import assert_exactly_once, read_ledger, start_worker, stored

pytestmark = pytest.mark.integration


def wait_all(procs, timeout_s: float = 60.0) -> None:
    for p in procs:
        assert p.wait(timeout=timeout_s) == 0


def drain(run, policy: str = "policy", n: int = 8, steps: int = 100) -> list[list[int]]:
    """A trainer client that consumes everything there is; returns the ids of each step."""
    t = client(run)
    t.call(m.Ready(m.PROTOCOL_VERSION, policy, 0))
    served = []
    for step in range(1, steps + 1):
        try:
            reply = t.call(m.Batch(policy, step, n), timeout_s=5)
        except RemoteError as e:
            assert e.code == "exhausted"
            break
        ids = reply.sample_ids.tolist()
        t.call(m.Consumed(policy, step, ids))
        served.append(ids)
    return served


def test_end_to_end_commit_serve_inspect(tmp_path):
    run = make_run(tmp_path, ["tasks.max_tasks=12"])
    df = DataflowProcess(run)
    df.start()
    try:
        wait_all([start_worker(run, "w1"), start_worker(run, "w2")])
        live = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "inspect", str(run.path), "--json"],
                              capture_output=True, text=True, cwd=REPO, check=True)
        live_report = json.loads(live.stdout)
        assert live_report["trajectories"] == 48  # read while the writer holds the shard
        assert live_report["live"]["tasks"]["done"] == 12  # and the rank's own status
        served = drain(run)
        status = client(run).call(m.Status()).status
    finally:
        df.stop()
    flat = [s for step in served for s in step]
    assert len(flat) == len(set(flat)) == status["policies"]["policy"]["consumed"]
    assert status["policies"]["policy"]["stored"] == 48 == len(flat) + status["policies"]["policy"]["filtered"]
    assert_exactly_once(run, 12, 4, [read_ledger(run, "w1"), read_ledger(run, "w2")])
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "inspect", str(run.path), "--json"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    report = json.loads(out.stdout)
    assert report["live"] is None  # the rank is gone
    assert report["trajectories"] == 48 and report["policies"]["policy"]["consumed"] == len(flat)
    per_worker = report["policies"]["policy"]["per_worker"]
    assert set(per_worker) <= {"w1.r0", "w2.r0"} and sum(per_worker.values()) == 48


def test_expired_lease_is_handed_out_again_and_renewed_lease_is_not(tmp_path):
    run = make_run(tmp_path, ["dataflow.lease_s=0.6"])
    df = DataflowProcess(run)
    df.start()
    try:
        a, b = client(run), client(run)
        wa, wb = register(a, "a"), register(b, "b")
        kept, dropped = a.call(m.Lease(wa, 2)).tasks
        for _ in range(6):  # renew one lease for 1.8 s, three times its duration
            time.sleep(0.3)
            assert a.call(m.Renew(wa, [kept.task_id])).renewed == [kept.task_id]
        got = b.call(m.Lease(wb, 1)).tasks
        assert [t.task_id for t in got] == [dropped.task_id]
        with pytest.raises(RemoteError, match="not_holder"):  # a's lease expired and b holds the task now
            a.call(m.Commit(wa, dropped.task_id, batch_for(dropped)))
        assert b.call(m.Commit(wb, dropped.task_id, batch_for(dropped))).status == "stored"
        assert a.call(m.Renew(wa, [dropped.task_id])).lost == [dropped.task_id]
    finally:
        df.stop()
    assert (stored(run)["task_id"] == dropped.task_id).sum() == 4


def batch_for(task: m.Task) -> m.TrajectoryBatch:
    rng = np.random.default_rng(task.task_id)
    return m.TrajectoryBatch.from_trajectories(
        [random_trajectory(rng, "policy", 16, prompt_tokens=4, group_id=task.task_id) for _ in range(task.group_size)])


def test_worker_sigkilled_mid_lease_loses_nothing(tmp_path):
    run = make_run(tmp_path, ["tasks.max_tasks=16", "dataflow.heartbeat_timeout_s=1.5", "dataflow.lease_s=600"])
    df = DataflowProcess(run)
    df.start()
    try:
        doomed = start_worker(run, "doomed", "--hold-after", "3")
        deadline = time.monotonic() + 30
        while len(read_ledger(run, "doomed")) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # it now holds two leases
        doomed.kill()
        doomed.wait()
        t0 = time.monotonic()
        wait_all([start_worker(run, "survivor")])
        status = client(run).call(m.Status()).status
    finally:
        df.stop()
    assert status["tasks"]["done"] == 16 and status["workers"]["dead"] >= 1
    assert time.monotonic() - t0 < 30
    assert_exactly_once(run, 16, 4, [read_ledger(run, "doomed"), read_ledger(run, "survivor")])


def test_dataflow_sigkilled_repeatedly_keeps_every_acknowledged_trajectory(tmp_path):
    run = make_run(tmp_path, ["tasks.max_tasks=80"])
    df = DataflowProcess(run)
    df.start()
    rng = random.Random(1234)
    workers = [start_worker(run, f"w{i}", "--timeout", "1.0") for i in range(3)]
    try:
        for _ in range(3):
            time.sleep(rng.uniform(0.3, 1.2))
            df.kill(signal.SIGKILL)
            df.start()
        wait_all(workers, timeout_s=120)
        status = client(run).call(m.Status()).status
    finally:
        df.stop()
    assert status["incarnation"] == 4 and status["tasks"]["done"] == 80
    ledgers = [read_ledger(run, f"w{i}") for i in range(3)]
    assert sum(len(x) for x in ledgers) >= 80
    assert_exactly_once(run, 80, 4, ledgers)


def test_trainer_resume_is_re_served_exactly_its_lost_steps(tmp_path):
    run = make_run(tmp_path, ["tasks.max_tasks=24", "policies.policy.filter_zero_advantage=false"])
    df = DataflowProcess(run)
    df.start()
    try:
        wait_all([start_worker(run, "w1")])
        t = client(run)
        t.call(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
        steps = {}
        for step in range(1, 6):
            steps[step] = t.call(m.Batch("policy", step, 8)).sample_ids.tolist()
            t.call(m.Consumed("policy", step, steps[step]))
        in_flight = t.call(m.Batch("policy", 6, 8)).sample_ids.tolist()  # served, never acknowledged
        # the trainer dies; its last checkpoint was after step 2
        assert t.call(m.Ready(m.PROTOCOL_VERSION, "policy", 2)).replay_steps == [3, 4, 5]
        for step in (3, 4, 5):
            reply = t.call(m.Batch("policy", step, 8))
            assert reply.replay and reply.sample_ids.tolist() == steps[step]
            t.call(m.Consumed("policy", step, steps[step]))
        fresh = t.call(m.Batch("policy", 6, 8)).sample_ids.tolist()
        assert sorted(fresh) == sorted(in_flight)  # unacknowledged samples came back, nothing else
        t.call(m.Consumed("policy", 6, fresh))
        # now the dataflow rank dies too; the trainer restarts from a checkpoint after step 4
        df.kill(signal.SIGKILL)
        df.start()
        t = client(run)
        assert t.call(m.Ready(m.PROTOCOL_VERSION, "policy", 4)).replay_steps == [5, 6]
        assert t.call(m.Batch("policy", 5, 8)).sample_ids.tolist() == steps[5]
        assert t.call(m.Batch("policy", 6, 8)).sample_ids.tolist() == fresh
        seven = t.call(m.Batch("policy", 7, 8)).sample_ids.tolist()
        trained = {s for ids in steps.values() for s in ids} | set(fresh)
        assert not set(seven) & trained and len(seven) == 8
    finally:
        df.stop()


def test_hostile_input_is_rejected_and_service_continues(tmp_path):
    run = make_run(tmp_path, ["dataflow.max_message_mb=1"])
    df = DataflowProcess(run)
    info = df.start()
    try:
        ctx = zmq.Context.instance()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(info["address"])
        good = client(run)
        secret = run.read_secret()
        codec = Codec(secret)
        attempts = {
            "garbage": [b"\x00\xff garbage"],
            "junk frames": [b"a", b"b", b"c", b"d"],  # not the three of a message
            "wrong signature": Codec(b"x" * 32).pack(m.Status(), b"r" * 16, 1),
            "unsigned": [codec.pack(m.Status(), b"r" * 16, 2)[0], b"", codec.pack(m.Status(), b"r" * 16, 2)[2]],
            # over the 1 MiB limit: counted and dropped by the codec
            "oversized": codec.pack(m.Heartbeat("w", {"x" * (3 << 19): 1}), b"r" * 16, 3),
            # over twice the limit: ZeroMQ drops the connection before buffering it
            "huge": codec.pack(m.Heartbeat("w", {"x" * (3 << 20): 1}), b"r" * 16, 4),
        }
        for name, frames in attempts.items():
            rogue.send_multipart(frames)
            assert not rogue.poll(300), f"{name}: an unauthenticated or oversized message got an answer"
            assert isinstance(good.call(m.Status()), m.StatusReply), name
        captured = codec.pack(m.Status(), b"q" * 16, 1)
        rogue.send_multipart(captured)
        assert rogue.poll(2000)
        rogue.recv_multipart()
        rogue.send_multipart(captured)  # replayed: answered with an error, never executed twice
        env, reply = codec.reply(rogue.recv_multipart())
        assert isinstance(reply, m.Error) and reply.code == "replayed"
        with pytest.raises(RemoteError, match="version_mismatch"):
            good.call(m.Register(m.PROTOCOL_VERSION + 1, "future", ["policy"], 1))
        counters = good.call(m.Status()).status["protocol"]["counters"]
    finally:
        df.stop()
    assert counters["rejected_malformed"] >= 2 and counters["rejected_unauthorized"] >= 2
    assert counters["rejected_oversized"] == 1 and counters["rejected_replayed"] == 1
    assert counters["error_version_mismatch"] == 1


def test_bad_config_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies: [{name: p}]\ndataflow: {lease_seconds: 3}\n")
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "dataflow", "--run-dir", str(tmp_path / "r"),
                          "--config", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2
    assert f"{bad}:2: dataflow.lease_seconds: unknown key" in out.stderr
    assert not (tmp_path / "r").exists()  # nothing was created for a config that does not validate


def test_a_config_that_no_longer_matches_the_stored_data_stops_the_rank_with_one_line(tmp_path):
    """A policy renamed in an existing run's config.yaml: the rank exits 1 with one line naming
    the shard and both policy lists, and moves nothing (it used to quarantine every shard)."""
    run_dir = trained_run_dir(tmp_path)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("- name: policy\n", "- name: solver\n"))
    shards = sorted(p.relative_to(run_dir) for p in (run_dir / "shards").rglob("*.h5"))
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "dataflow", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("astraflow dataflow: error: ") and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"{run_dir}/shards/shard-000000.h5 stores policies ['policy'] but the run's config names ['solver']" in last
    assert sorted(p.relative_to(run_dir) for p in (run_dir / "shards").rglob("*.h5")) == shards


def test_a_forgotten_worker_registers_once_however_many_calls_learn_of_it(tmp_path):
    """Declared dead (silent past the heartbeat timeout), a rollout worker with 8 calls in
    flight registers again once: each registration ends the incarnation before it, so one per
    call made them end each other, and hand back each other's leases, in a cascade."""
    from astraflow.protocol.aclient import AsyncClient
    from astraflow.rollout.worker import RolloutWorker

    run = make_run(tmp_path, ["dataflow.heartbeat_timeout_s=0.5"])
    df = DataflowProcess(run)
    info = df.start()
    worker = RolloutWorker(run, ["policy"], "w", engines={})

    async def scenario() -> None:
        worker.client = AsyncClient(info["address"], run.read_secret(), timeout_s=5)
        await worker.rpc(lambda: m.Heartbeat(worker.worker_id))  # registers
        await asyncio.sleep(1.5)  # declared dead meanwhile
        await asyncio.gather(*(worker.rpc(lambda: m.Heartbeat(worker.worker_id)) for _ in range(8)))
        worker.client.close()

    try:
        asyncio.run(scenario())
    finally:
        df.stop()
    assert worker.worker_id == "w.r1"


def test_a_message_captured_before_a_restart_of_the_rank_is_not_executed_after_it(tmp_path):
    """Replay protection remembered sequence numbers in memory only: a signed Register captured
    on the wire was executed again, once, by the restarted rank (a new incarnation of its
    worker, whose leases it handed back). Now a message signed before the rank started is
    dropped unanswered (an honest client's retry is signed afresh)."""
    run = make_run(tmp_path)
    df = DataflowProcess(run)
    info = df.start()
    ctx = zmq.Context.instance()
    try:
        sender = ctx.socket(zmq.DEALER)
        sender.setsockopt(zmq.LINGER, 0)
        sender.connect(info["address"])
        captured = Codec(run.read_secret()).pack(m.Register(m.PROTOCOL_VERSION, "victim", ["policy"], 4), b"v" * 16, 1)
        sender.send_multipart(captured)
        assert sender.poll(5000)
        sender.close(0)
        time.sleep(1.5)  # the message is now older than the slack the restarted rank allows
        df.kill(signal.SIGKILL)
        info = df.start()
        replayer = ctx.socket(zmq.DEALER)
        replayer.setsockopt(zmq.LINGER, 0)
        replayer.connect(info["address"])
        replayer.send_multipart(captured)
        assert not replayer.poll(1000)
        replayer.close(0)
        counters = client(run).call(m.Status()).status["protocol"]["counters"]
    finally:
        df.stop()
    journal = [json.loads(line) for line in (run.path / "journal" / "journal.jsonl").read_text().splitlines()]
    assert [e["worker"] for e in journal if e["ev"] == "register"] == ["victim.r0"]
    assert counters["rejected_signed_before_start"] == 1
