"""A journal or active shard deleted or replaced under the running rank stops it before it
acknowledges writes that went nowhere, with what the file held rescued next to it; a rank
started on shards whose journal is missing or begins later than the run refuses to start.

Before: the rank kept writing into the deleted journal's inode, its restart began a new
journal, and the trainer's ledger showed steps 1-60 missing and 128 samples trained twice."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from astraflow.bench.payload import random_trajectory
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from astraflow.store.errors import StoreRefused
from astraflow.store.identity import FileVanished
from astraflow.store.reader import ShardReader
from tests.conftest import make_run, recovered_state


def commit(state: DataflowState, worker: str, task: int) -> None:
    rng = np.random.default_rng(task)
    trajs = [random_trajectory(rng, "policy", 8, prompt_tokens=2, reward=float(i % 2), group_id=task) for i in range(4)]
    assert state.handle(m.Commit(worker, task, m.TrajectoryBatch.from_trajectories(trajs))).status == "stored"


@pytest.fixture
def serving(tmp_path):
    """A rank's state with one commit flushed and a second task leased."""
    run = make_run(tmp_path, ["tasks.group_size=4"])
    state = recovered_state(run.path)
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["policy"], 2)).worker_id
    tasks = [t.task_id for t in state.handle(m.Lease(worker, 2)).tasks]
    commit(state, worker, tasks[0])
    state.flush()
    yield run.path, state, worker, tasks
    state.close()


def test_a_journal_deleted_under_the_rank_stops_it_and_its_content_is_rescued(serving):
    run_dir, state, worker, tasks = serving
    journal = run_dir / "journal" / "journal.jsonl"
    journal.unlink()
    commit(state, worker, tasks[1])
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))  # journalled: the trainer's start
    with pytest.raises(FileVanished, match=r"journal.jsonl \(the run's journal\) was deleted while the dataflow "
                                           r"rank was writing it") as stopped:
        state.flush()  # the commit's reply would follow this flush: it is never sent
    (rescued,) = journal.parent.glob("journal.jsonl.rescued-*")
    assert str(rescued) in str(stopped.value) and "\n" not in str(stopped.value)
    assert [json.loads(line)["ev"] for line in rescued.read_text().splitlines()][0] == "start"
    state.close()

    with pytest.raises(StoreRefused, match=rf"journal.jsonl is missing or empty but shard-000000.h5 holds the "
                                           rf"run's data: .* rescued a copy when it saw it go: {rescued}"):
        recovered_state(run_dir)
    os.replace(rescued, journal)  # the operator restores it: the run resumes where it was
    state = recovered_state(run_dir)
    assert set(state.tasks.done) == set(tasks) and state.incarnation == 2
    state.close()


def test_a_journal_replaced_under_the_rank_stops_it(serving):
    run_dir, state, worker, tasks = serving
    journal = run_dir / "journal" / "journal.jsonl"
    other = journal.with_name("other")
    other.write_text(journal.read_text())
    os.replace(other, journal)  # same content, another file: what the rank writes would not be in it
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    with pytest.raises(FileVanished, match="was replaced by another file"):
        state.flush()


def test_an_active_shard_deleted_under_the_rank_stops_it_and_its_content_is_rescued(serving):
    run_dir, state, worker, tasks = serving
    shard = run_dir / "shards" / state.store.active_shard
    shard.unlink()
    commit(state, worker, tasks[1])
    with pytest.raises(FileVanished, match=r"shard-000000.h5 \(the active shard\) was deleted"):
        state.flush()
    (rescued,) = shard.parent.glob("shard-000000.h5.rescued-*")
    reader = ShardReader(rescued, writer_alive=False)
    assert reader.n_rows == 8  # both commits: a consistent image of the file as flushed
    reader.close()


def test_a_journal_that_begins_later_than_the_run_is_refused(tmp_path):
    """A journal started afresh next to existing shards (what a restart after a deletion did)."""
    run = make_run(tmp_path, ["tasks.group_size=4"])
    state = recovered_state(run.path)
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["policy"], 1)).worker_id
    commit(state, worker, state.handle(m.Lease(worker, 1)).tasks[0].task_id)
    state.flush()
    state.close()
    journal = run.path / "journal" / "journal.jsonl"
    journal.write_text(json.dumps({"ev": "start", "incarnation": 1, "time": 0.0, "first_sample": 4}) + "\n")
    with pytest.raises(StoreRefused, match="begins with incarnation 1 at sample 4, not at the run's start"):
        recovered_state(run.path)
