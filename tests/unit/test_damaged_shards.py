"""A shard damaged in place — bytes overwritten in the middle of a real file, as a failing
disk or a stray write leaves it — is never fatal: the dataflow rank's recovery quarantines
it (or keeps the rows before a damaged row) and starts; `load_rows`, `inspect` and `audit`
report it instead of raising; nothing waits on it.

Before: h5py raised RuntimeError or KeyError that the reader did not catch (the rank could
not restart, audit crashed), and in SWMR-read mode a bad metadata checksum was retried with
doubling sleeps, 100 times: a reader that never returned.
"""
from __future__ import annotations

import faulthandler
import re
import time

import h5py
import pytest

from astraflow.analysis.audit import audit
from astraflow.analysis.inspect import inspect_run
from astraflow.config.rundir import RunDir
from astraflow.dataflow.server import DataflowServer
from astraflow.dataflow.state import DataflowState, ShardDamaged
from astraflow.protocol import messages as m
from astraflow.store.journal import replay
from astraflow.store.reader import load_rows
from astraflow.store.schema import ROW_DTYPE
from astraflow.store.writer import list_shards
from tests.conftest import trained_run_dir

DAMAGED_ROW = 20  # of 32


def position(shard, where: str) -> int:
    """Where in the file to overwrite: found in the file itself, not hard-coded."""
    data = shard.read_bytes()
    if where == "superblock":
        return 36  # root object address and checksum of the v3 superblock
    if where == "object header":
        return [m.start() for m in re.finditer(b"OHDR", data)][-1] + 16
    if where == "chunk index":
        return data.index(b"EAIB") + 16
    with h5py.File(shard, "r", swmr=True) as f:
        if where == "row table":
            return f["rows"].id.get_chunk_info(0).byte_offset + DAMAGED_ROW * ROW_DTYPE.itemsize \
                + ROW_DTYPE.fields["offset"][1]
        return f["tokens"].id.get_chunk_info(0).byte_offset + 400  # token data


@pytest.fixture(autouse=True)
def no_hang():
    """A reader that waits on a damaged file is the bug: fail (with a traceback) rather than wait."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("killed", [False, True], ids=["closed", "killed"])
@pytest.mark.parametrize("where", ["superblock", "object header", "chunk index", "row table", "token data"])
def test_a_shard_damaged_in_place_is_reported_and_the_rank_recovers(tmp_path, where, killed, caplog):
    run_dir = trained_run_dir(tmp_path, killed=killed)
    (shard,) = list_shards(run_dir / "shards")
    at = position(shard, where)
    with open(shard, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 16)
    t0 = time.monotonic()

    report = audit(run_dir)  # on the damaged run: a report, not an exception
    looked = inspect_run(run_dir, live=False)
    df = load_rows(run_dir)
    if where in ("superblock", "object header", "chunk index"):
        assert not report["ok"] and report["unreadable_shards"]
        if where != "chunk index":  # inspect reads rows only; audit also walks the data's chunk index
            assert looked["unreadable"] and df.attrs["skipped"]
    elif where == "row table":
        assert len(df) == DAMAGED_ROW and df.attrs["torn"] == {shard.name: 32 - DAMAGED_ROW}
        assert looked["torn_rows"] == df.attrs["torn"] and report["torn_rows"] == df.attrs["torn"]
    else:
        assert report["ok"] and len(df) == 32  # token data has no checksum: not detectable

    state = DataflowState(run_dir, RunDir.open(run_dir).config, clock=lambda: 1000.0)
    state.recover()  # the rank starts
    store = state.handle(m.Status()).status["store"]
    done = state.tasks.done
    state.close()
    if where in ("superblock", "object header", "chunk index"):
        assert len(store["quarantined"]) == 1 and (run_dir / "shards" / "quarantine" / shard.name).exists()
        assert not done and "quarantined shard" in caplog.text  # its tasks are handed out again
        after = audit(run_dir)
        assert after["quarantined_shards"] == 1 and not after["unreadable_shards"]
        assert after["unreadable_quarantined"] == [shard.name] or after["lost"] > 0  # reported, not ok
        assert not after["ok"]
    elif where == "row table":
        assert store["torn_rows"] == {shard.name: 32 - DAMAGED_ROW} and not store["quarantined"]
        assert len(done) == DAMAGED_ROW // 4
    else:
        assert not store["quarantined"] and len(done) == 8
    assert time.monotonic() - t0 < 30, f"{time.monotonic() - t0:.0f}s spent on one damaged shard"


def test_a_shard_found_damaged_while_serving_stops_the_rank_and_its_restart_quarantines_it(tmp_path):
    """Damage recovery cannot see (the data itself, here the metadata bytes of every record)
    shows when a sample is served: the rank journals the shard as damaged and stops (before,
    every batch request got an `internal` error and the trainer asked again forever); the
    restart quarantines it and hands its tasks out again."""
    run_dir = trained_run_dir(tmp_path, steps=1)  # 16 samples still to serve
    (shard,) = list_shards(run_dir / "shards")
    with h5py.File(shard, "r", swmr=True) as f:
        meta, size = f["meta_bytes"].id.get_chunk_info(0).byte_offset, f["meta_bytes"].shape[0]
    with open(shard, "r+b") as f:
        f.seek(meta)
        f.write(b"\xff" * size)
    server = DataflowServer(RunDir.open(run_dir), local=True)
    try:
        with pytest.raises(ShardDamaged, match=f"{shard.name} cannot be read back"):
            server._handle(m.Batch("policy", 2, 16, 0, 1, 1), server.state.clock())
    finally:
        server.state.close()
        server.sock.close(0)
        server.ctx.term()
    assert [ev["shard"] for ev in replay(run_dir / "journal") if ev["ev"] == "damaged"] == [shard.name]
    state = DataflowState(run_dir, RunDir.open(run_dir).config, clock=lambda: 1000.0)
    state.recover()
    store = state.handle(m.Status()).status["store"]
    assert store["quarantined"][0].startswith(f"{shard.name}: found damaged while serving")
    assert not state.tasks.done and state.buffers["policy"].buffered == 0
    state.close()
