"""Storage failures: the run directory's filesystem fills up (a whole run; the rank's own
flush with no margin left); a shard is truncated and a weight file overwritten with garbage
while the run is stopped. Real files on a real size-limited tmpfs (root needed: without it
they skip, and under CI=true fail, `tests/ci_skips.py`)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from astraflow.analysis.audit import audit, lineage
from astraflow.bench.payload import random_trajectory
from astraflow.dataflow.state import DataflowState, StoreFull
from astraflow.protocol import messages as m
from astraflow.store.reader import ShardCorrupt, ShardReader, iter_shards, load_rows
from astraflow.weights.manifest import DELTA_FILE, FULL_FILE, newest_dir, read_manifest
from tests.chaos.harness import check_ledgers_and_audit, finish, resume, run_fails_after, start, wait_steps
from tests.conftest import make_run

pytestmark = pytest.mark.chaos

if os.geteuid() != 0:
    pytest.skip("mounting a size-limited tmpfs needs root", allow_module_level=True)


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Take every free byte of the filesystem."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass
    return filler


def commit_group(state: DataflowState, worker: str, task: int, tokens: int) -> None:
    rng = np.random.default_rng(task)
    trajs = [random_trajectory(rng, "policy", tokens, prompt_tokens=2, reward=float(i % 2), group_id=task)
             for i in range(4)]
    reply = state.handle(m.Commit(worker, task, m.TrajectoryBatch.from_trajectories(trajs)))
    assert getattr(reply, "status", None) == "stored", reply


def test_with_no_margin_a_turn_that_does_not_fit_never_reaches_hdf5(small_fs):
    """`store.min_free_mb: 0`: the guard still holds for what the turn staged. Without it HDF5
    ran out of space inside a flush, the rank died of SIGSEGV and left rows of zeros."""
    run = make_run(small_fs, ["store.min_free_mb=0", "tasks.group_size=4"])
    state = DataflowState(run.path, run.config)
    state.recover()
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["policy"], 4)).worker_id
    tasks = [t.task_id for t in state.handle(m.Lease(worker, 3)).tasks]
    commit_group(state, worker, tasks[0], tokens=1000)
    state.flush()
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_fs).free - (2 << 20)))  # 2 MB left
    commit_group(state, worker, tasks[1], tokens=100_000)  # 4 x 100k tokens: 5.6 MB staged
    with pytest.raises(StoreFull, match=r"MB free .* this turn writes up to"):
        state.flush()
    state.close()  # drops what was never acknowledged instead of writing it into the full disk
    filler.unlink()
    (shard,) = iter_shards(run.path)
    reader = ShardReader(shard)
    assert (reader.n_rows, reader.torn) == (4, 0)  # the flushed group, nothing of the refused one
    reader.close()
    state = DataflowState(run.path, run.config)
    state.recover()
    assert set(state.tasks.done) == {tasks[0]} and not state.store.quarantined
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["policy"], 4)).worker_id  # the new rank forgot it
    commit_group(state, worker, tasks[1], tokens=100_000)  # the worker's retry, now that there is room
    state.flush()
    state.close()
    assert audit(run.path)["ok"] and len(load_rows(run.path)) == 8


def test_full_filesystem_stops_the_run_cleanly_and_it_resumes_when_there_is_room(tmp_path, small_fs):
    run_dir = small_fs / "run"
    proc, _ = start(tmp_path, steps=14, extra=["launcher.max_restarts=2", "store.min_free_mb=4"], run_dir=run_dir)
    fillers = []
    message = run_fails_after(proc, run_dir, 3, lambda: fillers.append(fill(small_fs)), timeout_s=240)
    assert "No space left on device" in message or "MB free" in message, message
    fillers[0].unlink()
    for path in iter_shards(run_dir):  # nothing the full disk touched is corrupt
        ShardReader(path).close()
    assert not list((run_dir / "shards" / "quarantine").glob("*.h5"))
    print(message)
    proc = resume(run_dir)  # now that there is room
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    check_ledgers_and_audit(run_dir)


def test_truncated_shard_and_garbage_weights_are_detected_and_handled(tmp_path):
    proc, run_dir = start(tmp_path, steps=30, extra=["store.shard_max_mb=0.05"])
    try:
        wait_steps(proc, run_dir, 8)
        proc.send_signal(signal.SIGINT)  # stop; resume later from the run directory
        finish(proc, timeout_s=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    trained = {s for ev in lineage(run_dir).values() for s in ev["ids"]}
    for victim in reversed(list(iter_shards(run_dir))[:-1]):  # the newest closed shard with trained samples
        reader = ShardReader(victim)
        rows = reader.rows(("sample_id", "task_id"))
        reader.close()
        tasks = set(rows["task_id"].tolist())
        trained_tasks = {t for s, t in zip(rows["sample_id"].tolist(), rows["task_id"].tolist()) if s in trained}
        if trained_tasks:
            break
    assert trained_tasks, "no closed shard holds a trained sample: nothing to regenerate"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    weights = newest_dir(run_dir / "weights" / "policy")  # a full version or a delta: its weights file
    (weights / (FULL_FILE if read_manifest(weights).full else DELTA_FILE)).write_bytes(os.urandom(4096))

    proc = resume(run_dir)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    with pytest.raises(ShardCorrupt):
        ShardReader(run_dir / "shards" / "quarantine" / victim.name)
    assert "quarantined shard" in (run_dir / "logs" / "dataflow.log").read_text()
    assert tasks <= set(load_rows(run_dir)["task_id"].tolist())  # every task of it committed again
    trainer_log = (run_dir / "logs" / "trainer-policy.log").read_text()
    assert f"republishing {weights.name} from the checkpoint" in trainer_log
    assert json.loads(out[out.index("{"):])["steps"] == 30
    report = check_ledgers_and_audit(run_dir, lost_shards=True)
    assert report["regenerated"] >= len(trained_tasks)  # trained samples gone, their tasks done again


def test_a_journal_deleted_mid_run_stops_the_rank_and_the_rescued_copy_resumes_the_run(tmp_path):
    """Deleted mid-run, the journal went unnoticed: the rank wrote into the deleted file, its
    restart began a new journal, and audit said ok while the trainer's ledger showed steps
    missing and samples trained twice. Now the rank stops at its next journal write, rescuing
    what it held; its restart refuses to start without it; audit is not ok; and once the
    rescued copy is moved back the run resumes and finishes with audit ok."""
    proc, run_dir = start(tmp_path, steps=12, extra=["launcher.max_restarts=1"])
    journal = run_dir / "journal" / "journal.jsonl"
    # four metric rows: a step's row is written before its Consumed, so three steps are surely
    # acknowledged (and in the trainer's ledger) only once the fourth row is there
    message = run_fails_after(proc, run_dir, 4, journal.unlink, timeout_s=120)
    assert message.startswith("astraflow run: dataflow failed") and "journal.jsonl" in message, message
    rank_log = (run_dir / "logs" / "dataflow.log").read_text()
    assert "(the run's journal) was deleted while the dataflow rank was writing it" in rank_log
    assert "journal.jsonl is missing or empty but shard-" in rank_log  # and the restart refused
    report = audit(run_dir)
    assert not report["ok"] and report["ledgers"]["steps_missing_from_journal"] >= 3, report
    (rescued,) = journal.parent.glob("journal.jsonl.rescued-*")
    os.replace(rescued, journal)
    proc = resume(run_dir)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out[out.index("{"):])["steps"] == 12
    check_ledgers_and_audit(run_dir)
