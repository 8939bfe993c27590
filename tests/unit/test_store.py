"""HDF5 shards: round trip, rotation, SWMR reading, quarantine; the journal."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from astraflow.store.journal import Journal, replay
from astraflow.store.reader import ShardCorrupt, ShardReader, load_rows
from astraflow.store.shards import ShardStore
from astraflow.store.writer import ShardWriter, StoreOptions, list_shards
from tests.conftest import STORE_POLICIES as POLICIES, make_batch


@pytest.mark.parametrize("compression", ["none", "lzf", "gzip"])
def test_round_trip(tmp_path, compression):
    store = ShardStore(tmp_path, POLICIES, StoreOptions(compression=compression))
    batches = [make_batch(0, 4), make_batch(4, 4)]
    locs = [store.append(b) for b in batches]
    store.flush()
    (rec,) = store.read([locs[1][2]])  # sample 6
    assert rec["sample_id"] == 6 and rec["policy"] == "solver" and rec["meta"] == {"i": 6} and rec["guided"] == 1
    np.testing.assert_array_equal(rec["tokens"], batches[1].tokens["tokens"][100:150])
    np.testing.assert_array_equal(rec["token_policy"], batches[1].tokens["token_policy"][100:150])
    store.close()
    df = load_rows(_run_of(tmp_path))
    assert list(df["sample_id"]) == list(range(8)) and set(df["policy"]) == set(POLICIES)
    assert df["guided"].tolist() == [0, 0, 1, 0] * 2


def test_a_schema_1_shard_reads_with_no_guided_records_and_weight_1(tmp_path):
    """Shards written before the `guided` and `weight` columns (schema_version 1) stay readable:
    they read as 0 and 1 in the row table and in a single record."""
    store = ShardStore(tmp_path, POLICIES, StoreOptions())
    loc = store.append(make_batch(0, 4))[1]
    store.close()
    path = list_shards(tmp_path)[0]
    with h5py.File(path, "r+") as f:  # rewrite it as the old code did
        old = f["rows"][:]
        names = [n for n in old.dtype.names if n not in ("guided", "weight")]
        del f["rows"]
        f.create_dataset("rows", data=old[names].astype([(n, old.dtype[n]) for n in names]), maxshape=(None,))
        f.attrs["schema_version"] = 1
    reader = ShardReader(path)
    assert reader.rows(("sample_id", "guided"))["guided"].tolist() == [0, 0, 0, 0]
    assert reader.rows(("weight",))["weight"].tolist() == [1.0] * 4
    one = reader.trajectory(loc[1])
    assert one["guided"] == 0 and one["weight"] == 1.0 and one["sample_id"] == 1
    reader.close()


def _run_of(shard_dir):
    # load_rows takes a run directory whose shards live in RUN/shards
    run = shard_dir.parent / "run"
    (run / "shards").mkdir(parents=True, exist_ok=True)
    for p in list_shards(shard_dir):
        p.rename(run / "shards" / p.name)
    return run


def test_rotation_at_size_limit(tmp_path):
    store = ShardStore(tmp_path, POLICIES, StoreOptions(shard_max_bytes=5_000))
    for i in range(6):
        store.append(make_batch(i * 4, 4))
        store.flush()
    store.close()
    shards = list_shards(tmp_path)
    assert len(shards) >= 3
    rows = [ShardReader(p).rows()["sample_id"] for p in shards]
    assert np.concatenate(rows).tolist() == list(range(24))


def test_swmr_reader_follows_live_writer(tmp_path):
    writer = ShardWriter(tmp_path / "shard-000000.h5", POLICIES, StoreOptions())
    writer.stage(make_batch(0, 2))
    writer.flush()
    reader = ShardReader(tmp_path / "shard-000000.h5", locking=True)  # HDF5: same setting within a process
    assert reader.n_rows == 2
    writer.stage(make_batch(2, 3))
    writer.flush()
    assert reader.refresh() == 5 and reader.trajectory(4)["sample_id"] == 4
    reader.close()
    writer.close()


def test_malformed_batch_is_refused_at_stage_not_at_flush(tmp_path):
    writer = ShardWriter(tmp_path / "shard-000000.h5", POLICIES, StoreOptions())
    bad = make_batch(0, 2)
    bad.rows["length"] = np.array([50, 49], np.int32)
    with pytest.raises(ValueError, match="token arrays and lengths disagree"):
        writer.stage(bad)
    writer.close()


def test_truncated_and_garbage_shards_are_quarantined(tmp_path):
    store = ShardStore(tmp_path, POLICIES, StoreOptions(shard_max_bytes=1))
    for i in range(3):
        store.append(make_batch(i * 4, 4))
        store.flush()
    store.close()
    shards = list_shards(tmp_path)
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 3])  # truncated
    shards[2].write_bytes(b"\0garbage" * 100)
    store = ShardStore(tmp_path, POLICIES, StoreOptions())
    recovered = [(idx, rows["sample_id"].tolist()) for idx, _, rows in store.recover()]
    assert recovered == [(0, [0, 1, 2, 3])]
    assert len(store.quarantined) == 2 and (tmp_path / "quarantine" / shards[1].name).exists()
    store.append(make_batch(100, 2))
    store.flush()
    assert store.active_shard == "shard-000003.h5"  # numbered after the quarantined ones
    store.close()


def test_rows_pointing_past_their_data_are_a_torn_tail_and_the_rows_before_them_are_kept(tmp_path):
    path = tmp_path / "shard-000000.h5"
    writer = ShardWriter(path, POLICIES, StoreOptions())
    writer.stage(make_batch(0, 4))
    writer.close()
    assert ShardReader(path).n_rows == 4
    with h5py.File(path, "a") as f:  # token data lost under a row that was written
        f["logprobs"].resize((150,))
    reader = ShardReader(path)
    assert (reader.n_rows, reader.torn) == (3, 1) and reader.rows()["sample_id"].tolist() == [0, 1, 2]


def test_rows_of_zeros_after_a_write_cut_short_are_a_torn_tail(tmp_path):
    """ENOSPC inside HDF5 left the row table extended over rows that were never written: they
    read as zeros (sample 0, no tokens, offset 0). They are not records."""
    store = ShardStore(tmp_path, POLICIES, StoreOptions())
    for i in range(3):
        store.append(make_batch(i * 4, 4))
    store.close()
    (path,) = list_shards(tmp_path)
    with h5py.File(path, "a") as f:
        f["rows"].resize((12 + 8,))
    store = ShardStore(tmp_path, POLICIES, StoreOptions())
    ((_, reader, rows),) = list(store.recover())
    assert rows["sample_id"].tolist() == list(range(12)) and reader.torn == 8
    assert store.torn_rows == {path.name: 8} and not store.quarantined
    store.close()
    df = load_rows(_run_of(tmp_path))
    assert len(df) == 12 and df.attrs["torn"] == {path.name: 8}


def test_a_row_of_no_tokens_is_refused_when_staged(tmp_path):
    writer = ShardWriter(tmp_path / "shard-000000.h5", POLICIES, StoreOptions())
    bad = make_batch(0, 2)
    bad.rows["length"] = np.array([0, 100], np.int32)
    with pytest.raises(ValueError, match="no tokens"):
        writer.stage(bad)
    writer.close()


def test_journal_replay_ignores_torn_last_line(tmp_path):
    j = Journal(tmp_path)
    j.append("consumed", policy="p", step=1, ids=[1, 2])
    j.flush()
    j.close()
    with open(tmp_path / "journal.jsonl", "ab") as f:
        f.write(b'{"ev":"consumed","pol')  # a writer killed mid-line
    j = Journal(tmp_path)  # reopening fences the torn line off
    j.append("published", policy="p", version=3)
    j.close()
    assert [e["ev"] for e in replay(tmp_path)] == ["consumed", "published"]
