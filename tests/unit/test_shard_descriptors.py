"""Open shards are bounded and an error on opening one is classified (store/shards.py): a run of
more shards than the open-file limit recovers and serves with nothing quarantined; "too many
open files" on an open is tried again after the store gives descriptors back, and if it
persists the read fails as `ShardUnavailable`, a refusal that moves nothing. Only damage is
quarantined (tests/unit/test_damaged_shards.py, tests/chaos/test_storage.py).

Before: every shard stayed open, and any OSError on opening one, "too many open files"
included, quarantined a good shard: its tasks were generated again and its consumed samples
counted as lost. The limit and the errors are real: RLIMIT_NOFILE in a child process
(tests/unit/descriptor_child.py), descriptors taken there until the kernel refuses more.
"""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from astraflow.bench.payload import random_trajectory
from astraflow.config.rundir import RunDir
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from astraflow.store.errors import StoreStop
from astraflow.store.journal import replay
from astraflow.store.reader import ShardUnavailable
from astraflow.store.writer import list_shards
from tests.conftest import REPO, make_run

SHARDS = 300  # more than the limit of 256 open files


def run_with_shards(tmp_path: Path, shards: int) -> Path:
    """A run whose every committed group (4 samples) is a shard of its own (a tiny shard_max_mb)."""
    run = make_run(tmp_path, ["tasks.group_size=4", "store.shard_max_mb=0.0001", "dataflow.payload_cache_mb=0",
                              "policies.0.buffer_capacity=2048"])
    state = DataflowState(run.path, run.config, clock=lambda: 1000.0)
    state.recover()
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["policy"], shards)).worker_id
    rng = np.random.default_rng(0)
    for task in state.handle(m.Lease(worker, shards)).tasks:
        trajs = [random_trajectory(rng, "policy", 16, prompt_tokens=2, reward=float(i % 2), group_id=task.task_id)
                 for i in range(4)]
        state.handle(m.Commit(worker, task.task_id, m.TrajectoryBatch.from_trajectories(trajs)))
        state.flush()
    state.close()
    assert len(list_shards(run.path / "shards")) == shards
    return run.path


def child(mode: str, run_dir: Path, limit: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.unit.descriptor_child", mode, str(run_dir), str(limit)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_more_shards_than_the_open_file_limit_recover_and_serve_with_nothing_quarantined(tmp_path):
    run_dir = run_with_shards(tmp_path, SHARDS)
    seen = child("serve", run_dir, 256)
    assert seen["quarantined"] == [] and seen["retries"] == 0
    assert seen["served"] == 4 * SHARDS and seen["bad"] == 0  # every sample read back from its shard, intact
    assert seen["open_shards"] <= 64  # store.max_open_shards
    assert not (run_dir / "shards" / "quarantine").exists()


def test_too_many_open_files_on_opening_a_shard_is_tried_again_not_quarantined(tmp_path):
    """Every descriptor but three is taken: the fourth open or so finds none free, until the
    store closes the readers it holds and tries again."""
    run_dir = run_with_shards(tmp_path, 8)
    seen = child("squeeze", run_dir, 128)
    assert seen["quarantined"] == [] and seen["recovered"] == 8 and seen["rows"] == 32
    assert seen["retries"] > 0  # the error did happen, and was tried again
    assert len(list_shards(run_dir / "shards")) == 8


def test_an_open_error_that_persists_refuses_the_read_and_moves_nothing(tmp_path):
    run_dir = run_with_shards(tmp_path, 2)
    seen = child("starve", run_dir, 128)
    error = seen["error"]
    assert error is not None and (error["kind"], error["errno"]) == ("transient", errno.EMFILE)
    assert "Too many open files" in error["message"] and "tried 6 times" in error["message"]
    assert "\n" not in error["message"] and "nothing was moved" in error["message"]
    assert seen["read_after"] == 0 and seen["quarantined"] == [] and seen["shards"] == 2  # then it reads


@pytest.mark.parametrize("limit", [0, -1])
def test_max_open_shards_must_be_positive(tmp_path, limit):
    with pytest.raises(Exception, match=r"store.max_open_shards: expected >= 1"):
        make_run(tmp_path, [f"store.max_open_shards={limit}"])


def test_a_shard_deleted_under_the_rank_is_missing_not_damaged(tmp_path):
    """Reading back a sample whose shard was deleted stops the rank saying so; it is not
    journalled as damage (the restart has nothing to quarantine; audit reports what was lost)."""
    run_dir = run_with_shards(tmp_path, 3)
    state = DataflowState(run_dir, RunDir.open(run_dir, ["store.max_open_shards=1"]).config, clock=lambda: 1000.0)
    state.recover()
    assert state.store.open_shards == 1  # the last shard's reader: the first was closed, not held
    list_shards(run_dir / "shards")[0].unlink()
    with pytest.raises(ShardUnavailable, match=r"shard-000000.h5: .*No such file or directory\): missing, not "
                                                r"damage; nothing was moved") as stopped:
        state.handle(m.Batch("policy", 1, 8, 0, 1, 0))
    assert isinstance(stopped.value, StoreStop) and stopped.value.kind == "missing"
    state.close()
    assert not [ev for ev in replay(run_dir / "journal") if ev["ev"] == "damaged"]


HOLD_LOCK = "import h5py, sys, time; f = h5py.File(sys.argv[1], 'r+', locking=True); print('held', flush=True); " \
            "time.sleep(float(sys.argv[2]))"


@pytest.mark.parametrize("held_s", [0.3, 30.0], ids=["released", "held"])
def test_a_shard_locked_by_another_process_is_waited_for_then_refused_never_quarantined(tmp_path, held_s):
    """The holder of the lock may be a rank still exiting: recovery tries again for 1.55 s."""
    run_dir = run_with_shards(tmp_path, 2)
    shard = list_shards(run_dir / "shards")[1]
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(shard), str(held_s)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        state = DataflowState(run_dir, RunDir.open(run_dir).config, clock=lambda: 1000.0)
        if held_s < 1:
            state.recover()
            assert len(state.tasks.done) == 2 and state.store.retries > 0 and not state.store.quarantined
        else:
            with pytest.raises(ShardUnavailable, match=r"locked by another process .*tried 6 times") as refused:
                state.recover()
            assert refused.value.kind == "locked" and not state.store.quarantined
        state.close()
    finally:
        holder.kill()
        holder.wait()
    assert len(list_shards(run_dir / "shards")) == 2 and not (run_dir / "shards" / "quarantine").exists()
