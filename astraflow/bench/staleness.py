"""`astraflow bench staleness`: does asynchrony cost samples? The same config at its own
`max_staleness` (asynchronous) and at `max_staleness: 0` (strictly on-policy), over several
seeds per arm.

The measure is samples-to-target: trained samples until the moving average of the generated
reward first reaches `--target` (the summary's definition, `launch/summary.py`); a run that
never reaches it counts as infinitely many. Per arm: the median over seeds, and the
generated, trained and dropped counts of every run. Only `run.seed` and `max_staleness`
differ between runs; the rest of the config is the same. For single-policy configs: only the
first policy's `max_staleness` is set.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from astraflow.analysis.metrics import read_metrics
from astraflow.launch.local import run_local
from astraflow.launch.summary import policy_summary


def one_run(config: str, run_dir: Path, overrides: list[str], target: float) -> dict:
    summary = run_local(config, str(run_dir), overrides, quiet=True)
    policy = next(iter(summary["policies"]))
    rows = read_metrics(run_dir, policy)
    hit = policy_summary(rows, rows[0]["time"] if rows else 0.0, target)
    return {"samples_to_target": hit["samples_to_target"], "seconds_from_first_step_to_target": hit["time_to_target_s"],
            **{k: summary.get(k) for k in ("reward_first", "reward_last", "eval_accuracy_base", "eval_accuracy", "wall_s",
                                           "time_to_target_s", "samples_per_s", "generated", "trained",
                                           "dropped_stale", "filtered_zero_advantage")}}


def median_samples(runs: list[dict]) -> float:
    return statistics.median(r["samples_to_target"] if r["samples_to_target"] is not None else float("inf")
                             for r in runs)


def run_bench(config: str, seeds: list[int], target: float, extra: list[str], run_dir: str | None = None) -> dict:
    policy_key = "policies.0.max_staleness"
    arms: dict[str, list[dict]] = {"async": [], "on_policy": []}
    with tempfile.TemporaryDirectory(prefix="astraflow-bench-staleness-", dir=run_dir) as tmp:
        for seed in seeds:
            for arm, staleness in (("async", None), ("on_policy", 0)):
                overrides = [*extra, f"run.seed={seed}"] + ([f"{policy_key}={staleness}"] if staleness is not None else [])
                result = one_run(config, Path(tmp) / f"{arm}-{seed}", overrides, target)
                arms[arm].append({"seed": seed, **result})
    a, s = median_samples(arms["async"]), median_samples(arms["on_policy"])
    return {"config": config, "target": target, "seeds": seeds, "extra_overrides": list(extra),
            "async_median_samples_to_target": a, "on_policy_median_samples_to_target": s,
            "ratio": a / s if s not in (0, float("inf")) else None, "runs": arms}
