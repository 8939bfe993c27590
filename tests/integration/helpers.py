"""Helpers for integration tests: scripted worker processes and their ledgers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from astraflow.config.rundir import RunDir
from astraflow.store.reader import load_rows
from tests.conftest import REPO


def start_worker(run: RunDir, base: str, *extra: str) -> subprocess.Popen:
    log = open(run.path / "logs" / f"{base}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "tests.integration.scripted_worker", str(run.path),
                             "--base", base, "--ledger", str(ledger_path(run, base)), *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def ledger_path(run: RunDir, base: str) -> Path:
    return run.path / "logs" / f"{base}.ledger"


def read_ledger(run: RunDir, base: str) -> list[dict]:
    path = ledger_path(run, base)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stored(run: RunDir):
    """The shards' row table (pandas) of a run."""
    return load_rows(run.path)


def assert_exactly_once(run: RunDir, n_tasks: int, group: int, ledgers: list[list[dict]]) -> None:
    """Every task stored once with its whole group; every acknowledged sample is in a shard."""
    df = stored(run)
    per_task = df.groupby("task_id").size()
    assert sorted(per_task.index) == list(range(n_tasks)), f"tasks stored: {sorted(per_task.index)}"
    assert (per_task == group).all(), per_task[per_task != group]
    assert df["sample_id"].is_unique
    acked = {sid for ledger in ledgers for entry in ledger for sid in entry["sids"]}
    missing = acked - set(df["sample_id"])
    assert not missing, f"acknowledged but not stored: {sorted(missing)[:10]}"
