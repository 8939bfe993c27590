"""Protocol hardening: 200,000 hostile messages (or 60 s) against a live dataflow rank while a
correct client works; the seed is printed (ASTRAFLOW_FUZZ_SEED replays a run)."""
from __future__ import annotations

import os

import pytest

from astraflow.bench.fuzz import run_bench

pytestmark = pytest.mark.chaos


def test_rank_keeps_serving_a_correct_client_under_fuzz_and_ignores_strangers():
    seed = int(os.environ["ASTRAFLOW_FUZZ_SEED"]) if "ASTRAFLOW_FUZZ_SEED" in os.environ else None
    result = run_bench(seconds=60, max_messages=200_000, seed=seed)
    print({k: result[k] for k in ("seed", "messages_sent", "seconds", "handled_or_refused_per_s")})
    assert result["messages_sent"] >= 200_000 or result["seconds"] >= 60, result
    correct = result["correct_client"]
    assert correct["n_failures"] == 0 and correct["commits"] > 0, correct
    assert correct["p99_ms"] < 500, correct  # bounded: a correct client is not starved by the noise
    assert result["unauthenticated_client_got_nothing"]
    assert result["rank_counters"]["rejected_unauthorized"] > 0 and result["rank_counters"]["rejected_replayed"] > 0
