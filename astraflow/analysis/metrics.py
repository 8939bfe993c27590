"""Reading a trainer's per-step metrics (`RUN_DIR/metrics/<policy>.csv`), shared by the
progress line, the run summary and the plot. Only complete lines are returned: the trainer
may be writing the last one while it is read."""
from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(run_dir: str | Path, policy: str) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics" / f"{policy}.csv"
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (FileNotFoundError, csv.Error):
        return []
    out = []
    for row in rows:
        try:
            out.append({k: float(v) for k, v in row.items()})
        except (TypeError, ValueError):  # a line cut short
            continue
    return out
