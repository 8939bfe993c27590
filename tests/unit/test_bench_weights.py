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
