"""`astraflow inspect RUN_DIR`: what a run's shards hold, per policy. Works on a live run.

Reads the shards (SWMR) and the journal, so it works on a finished or crashed run too; when
the run's dataflow rank answers, its `status` document (same schema as `Status`) is added
under `live`. The version lag of a trajectory is the latest published version
of its policy when it was stored minus the oldest version that generated its tokens. Reward
means and spreads weigh each sample by its `weight` column (prompt selection), so they are
over the prompt set, as the training reward is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from astraflow.store.journal import replay
from astraflow.store.reader import iter_shards, load_rows

TIMELINE_BUCKETS = 10


LIVE_TIMEOUT_S = 1.0


def live_status(run_dir: Path) -> dict[str, Any] | None:
    """The dataflow rank's status if it is up and answers within a second, else None."""
    from astraflow.config.loader import ConfigError
    from astraflow.config.rundir import read_secret
    from astraflow.protocol.client import Client, read_rendezvous
    from astraflow.protocol.codec import RemoteError
    from astraflow.protocol.messages import Status

    try:
        client = Client(read_rendezvous(run_dir)["address"], read_secret(run_dir / "secret"), LIVE_TIMEOUT_S)
    except (OSError, ValueError, KeyError, ConfigError):
        return None
    try:
        return client.call(Status()).status
    except (TimeoutError, RemoteError):
        return None
    finally:
        client.close()


def inspect_run(run_dir: str | Path, live: bool = True) -> dict[str, Any]:
    run_dir = Path(run_dir)
    df = load_rows(run_dir)
    consumed: dict[str, int] = {}
    steps: dict[str, int] = {}
    for ev in replay(run_dir / "journal"):
        if ev.get("ev") == "consumed":
            steps[ev["policy"]] = max(steps.get(ev["policy"], 0), ev["step"])
            consumed[ev["policy"]] = consumed.get(ev["policy"], 0) + len(ev["ids"])
    report: dict[str, Any] = {
        "run_dir": str(run_dir),
        "shards": [p.name for p in iter_shards(run_dir)],
        "quarantined": sorted(p.name for p in (run_dir / "shards" / "quarantine").glob("*.h5")),
        "unreadable": df.attrs.get("skipped", []),
        "torn_rows": df.attrs.get("torn", {}),
        "trajectories": int(len(df)),
        "tasks": int(df["task_id"].nunique()) if len(df) else 0,
        "policies": {},
        "live": live_status(run_dir) if live else None,
    }
    if not len(df):
        return report
    t0, t1 = float(df["t_commit"].min()), float(df["t_commit"].max())
    edges = np.linspace(t0, t1 + 1e-9, TIMELINE_BUCKETS + 1)
    for policy, g in df.groupby("policy"):
        lag = (g["version_at_commit"] - g["version_min"]).clip(lower=0)
        bucket = np.clip(np.digitize(g["t_commit"], edges) - 1, 0, TIMELINE_BUCKETS - 1)
        sampled = g["guided"] == 0  # rewards are of what the policy generated, not of guided records
        timeline = []
        for b in range(TIMELINE_BUCKETS):
            sel = g[(bucket == b) & sampled]
            timeline.append({"t_s": round(float(edges[b] - t0), 3), "trajectories": int((bucket == b).sum()),
                             "reward_mean": _reward_mean(sel) if len(sel) else None})
        report["policies"][policy] = {
            "trajectories": int(len(g)),
            "guided": int((~sampled).sum()),
            "tokens": int(g["length"].sum()),
            "reward_mean": _reward_mean(g[sampled]),
            "reward_std": _reward_std(g[sampled]),
            "version_lag": {str(k): int(v) for k, v in lag.value_counts().sort_index().items()},
            "per_worker": {str(k): int(v) for k, v in g["worker"].value_counts().items()},
            "consumed": consumed.get(policy, 0),
            "trainer_step": steps.get(policy, 0),
            "timeline": timeline,
        }
    return report


def _reward_mean(rows: Any) -> float:
    """Mean reward over the prompt set: each sample weighted back for prompt selection."""
    return float(np.average(rows["reward"], weights=rows["weight"]))


def _reward_std(rows: Any) -> float:
    return float(np.sqrt(np.average((rows["reward"] - _reward_mean(rows)) ** 2, weights=rows["weight"])))


def format_report(r: dict[str, Any]) -> str:
    lines = [f"run {r['run_dir']}: {r['trajectories']} trajectories from {r['tasks']} tasks "
             f"in {len(r['shards'])} shards"]
    if r.get("live"):
        s = r["live"]
        waits = ", ".join(f"{p}: {v['trainer_wait_fraction']:.0%}" for p, v in s["policies"].items())
        lines.append(f"  live: {s['workers']['alive']} workers alive, tasks {s['tasks']['done']} done / "
                     f"{s['tasks']['leased']} leased, trainer waiting {waits}")
    for name in ("quarantined", "unreadable"):
        if r[name]:
            lines.append(f"  {name}: {', '.join(r[name])}")
    if r["torn_rows"]:
        lines.append("  torn tails ignored: " + ", ".join(f"{s} ({n} rows)" for s, n in r["torn_rows"].items()))
    for policy, p in r["policies"].items():
        guided = f" ({p['guided']} guided)" if p["guided"] else ""
        lines.append(f"policy {policy}: {p['trajectories']} trajectories{guided}, {p['tokens']} tokens, "
                     f"reward {p['reward_mean']:.3f} ± {p['reward_std']:.3f}, consumed {p['consumed']} "
                     f"(trainer step {p['trainer_step']})")
        lines.append("  version lag: " + ", ".join(f"{k}: {v}" for k, v in p["version_lag"].items()))
        top = list(p["per_worker"].items())
        more = f" (+{len(top) - 8} more)" if len(top) > 8 else ""
        lines.append(f"  per worker ({len(top)}): " + ", ".join(f"{k}: {v}" for k, v in top[:8]) + more)
        lines.append("  timeline: " + " ".join(str(b["trajectories"]) for b in p["timeline"]))
    return "\n".join(lines)
