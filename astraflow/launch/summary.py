"""`RUN_DIR/summary.json`: what a run achieved, from its own data.

reward_first / reward_last: mean reward of everything generated (filtered groups included)
over the first / last k steps that generated samples, k being 10% of the steps (a replayed
step, or one served from the buffer's surplus, generated nothing and is passed over: the
rewards are NaN only when the run generated nothing); time_to_target_s / samples_to_target:
the first step at which that reward over the last 5 such steps reaches `TARGET`
(`analysis/metrics.py`); trained: the samples of the run's steps, each step counted once (a
step replayed after a trainer restart is not counted again); samples_per_s: those per second
of the components' wall time (`components_s`: from their start, together with the model's
preparation, to their stop); failed_episodes: episodes handed back after an environment or tool failure, by kind (the
workers' `logs/episode-failures-*.jsonl`); eval_accuracy: greedy accuracy of the last published weights on
the held-out prompts (eval_accuracy_base: the same for the starting weights); wall_s: from the
start of the run (model build and warm-up included) to the end of that evaluation.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from astraflow.analysis.ledgers import episode_failures
from astraflow.analysis.metrics import generated_reward, generated_reward_smoothed, generating_window, read_metrics
from astraflow.config.rundir import RunDir

TARGET = 0.8


def policy_summary(rows: list[dict], t_start: float, target: float = TARGET) -> dict:
    """`rows`: one per step (`read_metrics`)."""
    if not rows:
        return {"steps": 0}
    k = max(1, len(rows) // 10)
    samples = np.cumsum([r["samples"] for r in rows])
    hit = np.flatnonzero(generated_reward_smoothed(rows) >= target)
    first = int(hit[0]) if len(hit) else None
    return {"steps": int(rows[-1]["step"]), "reward_first": generated_reward(generating_window(rows, k, last=False)),
            "reward_last": generated_reward(generating_window(rows, k)),
            "time_to_target_s": rows[first]["time"] - t_start if first is not None else None,
            "samples_to_target": int(samples[first]) if first is not None else None,
            "completion_len": float(np.mean([r["completion_len"] for r in rows])),
            "version_lag": float(np.mean([r["version_lag"] for r in rows])),
            "trained": int(samples[-1])}


def start_eval(run: RunDir, alongside: bool = False) -> subprocess.Popen:
    """`astraflow eval` as a child process; it needs only the published weights. `alongside`:
    started with the components, it imports its engine's library at once and scores when its
    stdin is closed (`training_done`), so that import overlaps the run's start-up."""
    args = [sys.executable, "-m", "astraflow.cli.main", "eval", "--run-dir", str(run.path)]
    with open(run.path / "logs" / "eval.log", "a") as log:
        return subprocess.Popen(args + ["--after-stdin"] * alongside, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if alongside else subprocess.DEVNULL)


def training_done(evaluation: subprocess.Popen) -> None:
    """Let an evaluation started `alongside` go on to score the starting and last weights."""
    evaluation.stdin.close()


def write_summary(run: RunDir, status: dict, started: float, t_components: float, t_stopped: float,
                  evaluation: subprocess.Popen | None = None) -> dict:
    """`started`: when the run (model build included) began; `t_components` / `t_stopped`:
    when its components started / were stopped. wall_s runs to the end of the evaluation."""
    evaluation = evaluation or start_eval(run)
    evals = (json.loads((run.path / "eval.json").read_text()) if evaluation.wait() == 0
             else {"eval_error": f"evaluation failed; see {run.path / 'logs' / 'eval.log'}"})
    components_s = t_stopped - t_components
    policies = {p: policy_summary(read_metrics(run.path, p), t_components) for p in run.config.policy_names}
    first = next(iter(policies.values()))
    counts = status["policies"]
    trained = sum(v.get("trained", 0) for v in policies.values())
    summary = {
        "run_dir": str(run.path),
        **{k: first.get(k) for k in ("reward_first", "reward_last", "steps", "time_to_target_s",
                                      "samples_to_target", "completion_len")},
        **evals,
        "wall_s": time.time() - started,
        "components_s": components_s,
        "trajectories": sum(c["stored"] for c in counts.values()),
        "generated": sum(c["stored"] - c["guided"] for c in counts.values()),
        "guided": sum(c["guided"] for c in counts.values()),  # reference answers added, not sampled
        "trained": trained,
        "dropped": sum(c["dropped_stale"] + c["filtered"] + c["unused"] for c in counts.values()),
        "dropped_stale": sum(c["dropped_stale"] for c in counts.values()),
        "filtered_zero_advantage": sum(c["filtered"] for c in counts.values()),
        "unused_trainer_done": sum(c["unused"] for c in counts.values()),
        "skipped_prompts": status["tasks"]["skipped"],  # never generated (prompt selection)
        "failed_episodes": episode_failures(run.path),  # by kind: handed back after an environment/tool failure
        "samples_per_s": trained / components_s if components_s else None,
        "target_reward": TARGET,
        "policies": policies,
    }
    (run.path / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _pair(first: float | None, last: float | None) -> str:
    return " -> ".join("-" if v is None or v != v else f"{v:.3f}" for v in (first, last))


def format_summary(summary: dict) -> str:
    """The end of `astraflow run` for a person: a few lines, the full record in summary.json."""
    run_dir = Path(summary["run_dir"])
    lines = [f"run {run_dir} finished in {summary['wall_s']:.1f}s ({summary['components_s']:.1f}s of components)"]
    for name, p in summary["policies"].items():
        if not p.get("steps"):
            lines.append(f"  {name}: no steps")
            continue
        target = (f", reached {summary['target_reward']} after {p['time_to_target_s']:.0f}s"
                  if p.get("time_to_target_s") is not None else "")
        lines.append(f"  {name}: {p['steps']} steps, reward (generated) {_pair(p['reward_first'], p['reward_last'])}"
                     f"{target}, mean version lag {p['version_lag']:.2f}")
    if "eval_accuracy" in summary:
        accuracy = _pair(summary.get("eval_accuracy_base"), summary["eval_accuracy"])
        lines.append(f"  held-out accuracy (greedy, starting -> last weights): {accuracy}")
    elif "eval_error" in summary or "eval_skipped" in summary:
        lines.append(f"  held-out accuracy: {summary.get('eval_error') or summary['eval_skipped']}")
    rate = f"{summary['samples_per_s']:.0f} samples/s" if summary.get("samples_per_s") else "no samples"
    lines.append(f"  {summary['trajectories']} trajectories stored, {summary['trained']} trained ({rate}), "
                 f"{summary['dropped']} dropped (stale {summary['dropped_stale']}, zero advantage "
                 f"{summary['filtered_zero_advantage']}, unused {summary['unused_trainer_done']})")
    if summary.get("failed_episodes"):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary["failed_episodes"].items()))
        lines.append(f"  episodes handed back after an environment or tool failure: {kinds} "
                     f"(logs/episode-failures-*.jsonl)")
    lines.append(f"  details: {run_dir / 'summary.json'}; curve: astraflow plot {run_dir}")
    return "\n".join(lines)
