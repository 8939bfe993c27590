"""`load_rows(closed_only=True)` (for NFS) leaves out only a shard that is open for writing:
a finished run's last shard is closed and read; a live or killed writer's is not."""
from __future__ import annotations

from astraflow.store.reader import load_rows
from astraflow.store.shards import ShardStore
from astraflow.store.writer import StoreOptions
from tests.conftest import STORE_POLICIES, make_batch, trained_run_dir


def test_a_finished_runs_last_shard_is_read(tmp_path):
    run = trained_run_dir(tmp_path)  # one shard, closed by the rank
    assert len(load_rows(run, closed_only=True)) == len(load_rows(run)) == 32


def test_a_shard_left_open_by_a_killed_writer_is_left_out(tmp_path):
    run = trained_run_dir(tmp_path, killed=True)
    assert len(load_rows(run)) == 32 and len(load_rows(run, closed_only=True)) == 0


def test_a_live_shard_is_left_out_and_the_rotated_ones_are_read(tmp_path):
    run = tmp_path / "run"
    # rotates at every flush; no locking, as the readers in this process (an HDF5 rule)
    store = ShardStore(run / "shards", STORE_POLICIES, StoreOptions(shard_max_bytes=1, locking=False))
    for i in range(3):
        store.append(make_batch(i * 4, 4))
        store.flush()
    store.append(make_batch(12, 4))
    store._active().flush()  # flushed into the live shard, not rotated: the writer keeps it open
    try:
        assert len(load_rows(run)) == 16
        assert sorted(load_rows(run, closed_only=True)["sample_id"]) == list(range(12))
    finally:
        store.close()
    assert len(load_rows(run, closed_only=True)) == 16
