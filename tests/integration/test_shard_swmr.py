"""A shard read while its writer appends (SWMR): a reader that refreshes a healthy live shard
must never call it corrupt or torn, nor lose rows it saw, nor see a row whose data is not
there yet.

The writer is a real process (`tests.integration.shard_appender`) flushing after every batch,
as the dataflow rank does; the reader is this process, as `astraflow inspect` and `audit` are
(every 100th refresh it also loads the run's rows as they do: the live shard is never skipped).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from astraflow.store.reader import ShardCorrupt, ShardReader, load_rows
from tests.conftest import REPO

pytestmark = pytest.mark.integration

BATCHES = 4000
ROWS = 8


def test_refreshing_a_live_shard_never_reports_it_corrupt(tmp_path):
    path = tmp_path / "run" / "shards" / "shard-000000.h5"
    path.parent.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-m", "tests.integration.shard_appender", str(path), str(BATCHES),
                               str(ROWS)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready", writer.communicate()[1][-3000:]
        reader = ShardReader(path)
        refreshes, corrupt, torn, seen = 0, [], 0, 0
        while writer.poll() is None:
            try:
                n = reader.refresh()
            except ShardCorrupt as e:
                corrupt.append(e.why)
                continue
            finally:
                refreshes += 1
            assert n >= seen, f"refresh {refreshes}: {n} rows after {seen}"
            torn += reader.torn > 0
            if refreshes % 100 == 0:  # what inspect and audit read: the live shard is not skipped
                df = load_rows(tmp_path / "run")
                assert not df.attrs["skipped"] and not df.attrs["torn"] and len(df) >= n, df.attrs
            if n > seen:  # the newest row's data is readable and is the row's own
                last = reader.trajectory(n - 1)
                assert last["sample_id"] == n - 1 and len(last["tokens"]) == last["length"]
            seen = n
        _, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err[-3000:]
        final = reader.refresh()
        reader.close()
    finally:
        if writer.poll() is None:
            writer.kill()
    print(f"{refreshes} refreshes, {len(corrupt)} reported corrupt, {torn} with a torn tail, {final} rows")
    assert refreshes >= 1000, f"only {refreshes} refreshes while the writer ran: the test proved little"
    assert not corrupt, f"{len(corrupt)} of {refreshes} refreshes called a healthy live shard corrupt: {corrupt[:3]}"
    assert torn == 0, f"{torn} of {refreshes} refreshes saw rows of a healthy live shard as a torn tail"
    assert final == BATCHES * ROWS
