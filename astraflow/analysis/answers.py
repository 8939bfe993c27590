"""`astraflow answers RUN_DIR`: each policy's mean reward per reference answer of its tasks,
over the versions that generated the samples — which answers a plateaued policy never gets
right, or got right at first and lost.

A training reward that stalls is an average; this splits it by the task's answer (the
`answer` of the prompt source, found from the task id). On the quickstart it showed that
the reward stops under 0.8 because the answers 10 and 20-27 (18.6% of the samples), right
0-7% of the time under the starting weights, are never right after the first 60-180
versions, while every other answer ends at 0.82-0.98.

Reads the shards (SWMR, so a live run works too) and the run's config; no torch. Versions
are split into `buckets` equal ranges of `version_min`, the oldest weights in a sample.
Rewards and sample counts are of what the policy sampled; reference answers a run added to
all-wrong groups (`workflow.reference_guidance`) are counted apart, as `guided`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from astraflow.config.rundir import RunDir
from astraflow.store.reader import load_rows
from astraflow.tasks.sources import TaskSource

LOST_BELOW = 0.01  # a mean reward below this counts as not learned (the text says "1%")


def _answer_key(answer: str) -> tuple[int, float, str]:
    """Numbers in numeric order, then other answers alphabetically."""
    try:
        return (0, float(answer), answer)
    except ValueError:
        return (1, 0.0, answer)


def answers_report(run_dir: str | Path, buckets: int = 5, top: int = 40) -> dict[str, Any]:
    """Per policy: the version buckets, and for the `top` answers with most samples their
    sample count and mean reward per bucket (None where a bucket has no sample); `lost`:
    answers rewarded in the first bucket and below LOST_BELOW in the last; `never`: below it
    in every bucket; `lost_share` / `never_share`: their fraction of the policy's samples."""
    run = RunDir.open(run_dir)
    source = TaskSource(run.config.tasks)
    df = load_rows(run.path)
    report: dict[str, Any] = {"run_dir": str(run.path), "policies": {}}
    if not len(df):
        return report
    answer_of = {tid: source.item(int(tid)).answer for tid in sorted(df["task_id"].unique())}
    df["answer"] = df["task_id"].map(answer_of)
    for policy, everything in df.groupby("policy"):
        # rewards are of what the policy sampled; reference answers (guided) are only counted
        guided = everything.loc[everything["guided"] == 1, "answer"].value_counts()
        g = everything[everything["guided"] == 0]
        edges = np.linspace(0, int(g["version_min"].max()) + 1, buckets + 1)
        bucket = np.clip(np.digitize(g["version_min"], edges) - 1, 0, buckets - 1)
        # weighted back for prompt selection (the `weight` column): means over the prompt set
        sums = g.assign(wr=g["reward"] * g["weight"]).groupby(["answer", bucket])[["wr", "weight"]].sum()
        means = (sums["wr"] / sums["weight"]).unstack()
        counts = g["answer"].value_counts()
        rows = []
        for answer in sorted(counts.index[:top], key=_answer_key):
            reward = [None if np.isnan(v) else round(float(v), 3) for v in means.loc[answer].reindex(range(buckets))]
            rows.append({"answer": answer, "samples": int(counts[answer]), "guided": int(guided.get(answer, 0)),
                         "reward": reward})
        low = (means.fillna(0.0) < LOST_BELOW).all(axis=1)
        never = sorted(low.index[low], key=_answer_key)
        lost = []
        if 0 in means and buckets - 1 in means:
            dropped = (means[0] >= LOST_BELOW) & (means[buckets - 1] < LOST_BELOW)
            lost = sorted(dropped.index[dropped], key=_answer_key)
        report["policies"][policy] = {
            "versions": [f"v{int(np.ceil(lo))}-{int(np.ceil(hi)) - 1}" for lo, hi in zip(edges[:-1], edges[1:])],
            "answers": rows, "distinct_answers": int(len(counts)),
            "lost": lost, "lost_share": round(float(counts[lost].sum() / len(g)), 4),
            "never": never, "never_share": round(float(counts[never].sum() / len(g)), 4),
        }
    return report


def format_answers(r: dict[str, Any]) -> str:
    lines = [f"run {r['run_dir']}: mean reward by reference answer, over the versions that generated it"]
    for policy, p in r["policies"].items():
        shown = len(p["answers"])
        more = f" (the {shown} most frequent of {p['distinct_answers']})" if shown < p["distinct_answers"] else ""
        lines.append(f"policy {policy}{more}:")
        lines.append(f"  {'answer':>8} {'samples':>8} {'guided':>7} " + " ".join(f"{v:>9}" for v in p["versions"]))
        for row in p["answers"]:
            cells = " ".join(f"{'-' if x is None else f'{x:.2f}':>9}" for x in row["reward"])
            lines.append(f"  {row['answer'][:8]:>8} {row['samples']:>8} {row['guided']:>7} {cells}")
        for name, what in (("lost", "rewarded at first, below 1% at the end"), ("never", "below 1% throughout")):
            if p[name]:
                lines.append(f"  {what}: {', '.join(p[name])} ({p[name + '_share']:.1%} of samples)")
    return "\n".join(lines)
