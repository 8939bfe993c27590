"""`astraflow bench restart` on a small run: a real dataflow rank recovers every trajectory the
bench wrote and every step it journalled as consumed, and reports its own peak memory."""
from __future__ import annotations

from astraflow.bench import restart
from astraflow.bench.restart import run_bench


def test_bench_restart_recovers_what_it_wrote():
    result = run_bench(stored=20_000, consumed_fraction=0.5)
    assert result["recovered_all"], result
    assert result["recovered"] == {"stored": 20_000, "consumed": 9_984}
    assert 0 < result["restart_to_serving_s"] < 60 and 0 < result["dataflow_peak_rss_mb"] < 1024


def test_bench_restart_resumes_from_the_compact_state(monkeypatch):
    monkeypatch.setattr(restart, "WRITE_ROWS", 4096)  # a flush each, the shard rotating every other one
    result = run_bench(stored=20_000, consumed_fraction=0.5, shard_mb=0.25, compact=True)
    assert result["recovered_all"] and result["from_compact_state"], result
    assert result["shards"] >= 3 and result["compact_state_mb"] > 0
