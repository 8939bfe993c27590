"""`astraflow bench learn`: does a config learn? Runs it once per seed and reports, per run and
as medians over seeds, what the learning targets are stated in: the generated reward over
the first and last 10% of steps, the greedy held-out score of the starting and the last
weights, wall time (model build, warm-up, vLLM start-up and evaluation included) and trained
samples/s. `--target-*` flags state the pass criteria (defaults: the real-LLM workload's,
`configs/math_chat.yaml`: reward from <= 0.3 to >= 0.6, held-out up by >= 0.2, <= 600 s);
`passed` says whether the medians meet them. The runs go to a temporary directory, removed at
the end, unless `keep` names a directory to hold them (`keep/seed-N`: metrics, shards,
summary; `astraflow plot keep/seed-N` draws a run's curve).
"""
from __future__ import annotations

import statistics
import tempfile
from contextlib import nullcontext
from pathlib import Path

from astraflow.launch.local import run_local

KEYS = ("reward_first", "reward_last", "eval_accuracy_base", "eval_accuracy", "wall_s", "samples_per_s", "generated",
        "trained", "dropped_stale", "filtered_zero_advantage", "guided")


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def run_bench(config: str, seeds: list[int], extra: list[str], first_at_most: float = 0.3, last_at_least: float = 0.6,
              heldout_gain: float = 0.2, wall_s: float = 600.0, run_dir: str | None = None,
              keep: str | None = None) -> dict:
    runs = []
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
    where = nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="astraflow-bench-learn-", dir=run_dir)
    with where as tmp:
        for seed in seeds:
            summary = run_local(config, str(Path(tmp) / f"seed-{seed}"), [*extra, f"run.seed={seed}"], quiet=True)
            runs.append({"seed": seed, **{k: summary.get(k) for k in KEYS}})
    for r in runs:
        base, last = r["eval_accuracy_base"], r["eval_accuracy"]
        r["heldout_gain"] = last - base if base is not None and last is not None else None
    medians = {k: _median(runs, k) for k in (*KEYS, "heldout_gain")}
    checks = {"reward_first": medians["reward_first"] is not None and medians["reward_first"] <= first_at_most,
              "reward_last": medians["reward_last"] is not None and medians["reward_last"] >= last_at_least,
              "heldout_gain": medians["heldout_gain"] is not None and medians["heldout_gain"] >= heldout_gain,
              "wall_s": medians["wall_s"] is not None and medians["wall_s"] <= wall_s}
    return {"config": config, "seeds": seeds, "extra_overrides": list(extra), "kept_in": keep,
            "targets": {"reward_first_at_most": first_at_most, "reward_last_at_least": last_at_least,
                        "heldout_gain_at_least": heldout_gain, "wall_s_at_most": wall_s},
            "medians": medians, "checks": checks, "passed": all(checks.values()), "runs": runs}
