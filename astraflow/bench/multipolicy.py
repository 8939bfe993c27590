"""`astraflow bench multipolicy`: co-training time per iteration, async against sync schedule.

The same workload runs twice on this machine, `schedule.mode=async` (the default: policies
advance independently, generation overlaps training, bounded by `max_staleness`) and
`schedule.mode=sync` (generate one batch per policy with the latest weights, then train, then
push weights), with the same components — the same worker and engine code, the same in-place
weight reload, the same episode concurrency, the same trainer code. Only the schedule differs.

The workload carries what makes agentic RL slow (fixed below and echoed in the JSON): each
generation decodes a long-tailed number of tokens (lognormal, p99/median 8, capped by
`engine.max_tokens`), and each answer makes an environment round-trip whose server-side
latency is lognormal (median 0.2 s, p99 2 s). A second pair of runs sets that latency to 0.

s/iter: from the first completed update to the last, divided by the updates in between,
the slowest policy counting (start-up — engines, model build, warm-up — is excluded from
both timings). Each mode is a separate run with its own engine processes, started once.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from astraflow.analysis.metrics import read_metrics
from astraflow.launch.local import run_local

WORKLOAD = {
    "workflow.env_check": "true",
    "workflow.decode_len_median": "4",
    "workflow.decode_len_p99_ratio": "8",
    "engine.max_tokens": "40",
    "workflow.env_latency_median_s": "0.2",
    "workflow.env_latency_p99_s": "2.0",
    "policies.0.max_staleness": "2",
    "policies.1.max_staleness": "2",
    "rollout.weight_poll_s": "0.05",
}


def seconds_per_iter(run_dir: Path, policies: list[str]) -> float:
    worst = 0.0
    for p in policies:
        rows = read_metrics(run_dir, p)
        if len(rows) < 2:
            raise RuntimeError(f"bench multipolicy: policy {p} made {len(rows)} updates in {run_dir}")
        worst = max(worst, (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1))
    return worst


def one_mode(config: str, mode: str, overrides: list[str], root: Path) -> dict:
    run_dir = root / f"{mode}"
    summary = run_local(config, str(run_dir), [*overrides, f"schedule.mode={mode}"], quiet=True)
    policies = list(summary["policies"])
    return {"s_per_iter": seconds_per_iter(run_dir, policies),
            "rewards": {p: {"first": s.get("reward_first"), "last": s.get("reward_last")}
                        for p, s in summary["policies"].items()},
            "eval": summary.get("eval", {}), "wall_s": summary["wall_s"], "generated": summary["generated"],
            "trained": summary["trained"], "dropped": summary["dropped"]}


def compare(config: str, overrides: list[str], root: Path) -> dict:
    a = one_mode(config, "async", overrides, root)
    s = one_mode(config, "sync", overrides, root)
    return {"async_s_per_iter": a["s_per_iter"], "sync_s_per_iter": s["s_per_iter"],
            "speedup": s["s_per_iter"] / a["s_per_iter"], "async": a, "sync": s}


def run_bench(config: str, steps: int, extra: list[str], zero_latency: bool = True, run_dir: str | None = None) -> dict:
    workload = {**WORKLOAD, "trainer.steps": str(steps)}
    overrides = [f"{k}={v}" for k, v in workload.items()] + list(extra)
    with tempfile.TemporaryDirectory(prefix="astraflow-bench-mp-", dir=run_dir) as tmp:
        root = Path(tmp)
        result = {"config": config, "workload": workload, "extra_overrides": list(extra),
                  **compare(config, overrides, root / "latency")}
        if zero_latency:
            zero = compare(config, [*overrides, "workflow.env_latency_median_s=0"], root / "zero-latency")
            result["zero_latency"] = {k: zero[k] for k in ("async_s_per_iter", "sync_s_per_iter", "speedup")}
    return result
