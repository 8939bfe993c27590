"""`astraflow bench weights` on a tiny model: real AdamW steps, each version published and
brought into an hf engine; at lr 1e-6 the versions after the first are small deltas, at a
high learning rate nearly every element moves and they are published full."""
from __future__ import annotations

from astraflow.bench.weights import run_bench


def test_bench_weights_reports_bytes_and_times_per_learning_rate():
    out = run_bench("qwen2", "tiny", [1e-6, 1e-2], versions=2, dtype_name="bfloat16", threads=1)
    small, large = out["results"]
    assert out["parameters"] > 0 and [len(r["versions"]) for r in out["results"]] == [3, 3]
    for r in (small, large):
        assert r["fp32_full_bytes"] == 2 * r["full_bytes"]  # bf16 published
        assert [v["how"] for v in r["versions"]][0] == "full"
        assert all(v["applied_s"] >= v["publish_s"] > 0 for v in r["versions"])
    assert small["published_as_delta"] == 2 and 0 < small["changed_fraction"] < 0.1
    assert small["delta_over_full"] < 0.2 and [v["how"] for v in small["versions"]] == ["full", "delta", "delta"]
    assert large["published_as_delta"] == 0 and large["changed_fraction"] > 0.5


def test_bench_weights_measures_the_collective_channel_beside_a_raw_broadcast():
    """Receivers in their own processes verify and install each version; the report holds the
    raw broadcast's and the channel's seconds for each worker count."""
    out = run_bench("qwen2", "tiny", [1e-6], versions=1, dtype_name="bfloat16", threads=1, workers=[1, 2], rounds=2)
    rows = out["collective"]["per_workers"]
    assert [r["workers"] for r in rows] == [1, 2]
    for r in rows:
        assert r["payload_bytes"] == out["results"][0]["full_bytes"]  # the whole bf16 version, aligned
        # a round's time is its slowest worker's; applied_s is every worker's of every round
        assert 0 < r["raw_s"] and 0 < r["received_s"] <= r["applied_p99_s"] and r["applied_p50_s"] <= r["applied_p99_s"]
        assert r["install_s"] > 0 and r["efficiency"] == r["raw_s"] / r["received_s"] and r["first_received_s"] > 0
    assert out["collective"]["applied_ratio"] == rows[1]["applied_p50_s"] / rows[0]["applied_p50_s"]
