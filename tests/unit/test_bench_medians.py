"""`bench multipolicy --seeds`: the reported figures are medians over seeds, per mode and policy."""
from astraflow.bench.multipolicy import medians


def seed_run(async_s: float, sync_s: float, solver_last: float, solver_eval: float) -> dict:
    def mode(last: float, held_out: float) -> dict:
        return {"rewards": {"solver": {"first": 0.1, "last": last}, "verifier": {"first": 0.5, "last": 0.5}},
                "eval": {"solver": {"base": 0.26, "last": held_out}}}
    return {"async_s_per_iter": async_s, "sync_s_per_iter": sync_s, "speedup": sync_s / async_s,
            "async": mode(solver_last, solver_eval), "sync": mode(solver_last + 0.1, solver_eval + 0.1),
            "zero_latency": {"async_s_per_iter": 1.0, "sync_s_per_iter": 1.5, "speedup": 1.5}}


def test_medians_over_seeds() -> None:
    runs = [seed_run(2.0, 6.0, 0.2, 0.3), seed_run(2.5, 5.0, 0.4, 0.5), seed_run(2.2, 7.7, 0.3, 0.9)]
    out = medians(runs)
    assert out["async_s_per_iter"] == 2.2 and out["sync_s_per_iter"] == 6.0
    assert out["speedup"] == 3.0  # the median of 3.0, 2.0 and 3.5, not 6.0 / 2.2
    assert out["async"]["reward_last"] == {"solver": 0.3, "verifier": 0.5}
    assert out["sync"]["eval_last"] == {"solver": 0.6}
    assert out["zero_latency"]["speedup"] == 1.5


def test_medians_without_zero_latency() -> None:
    run = seed_run(2.0, 6.0, 0.2, 0.3)
    del run["zero_latency"]
    assert "zero_latency" not in medians([run])
