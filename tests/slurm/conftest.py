"""A real Slurm cluster on this machine (tools/local-slurm.sh) and helpers to drive runs on it.

Without root (a laptop) the cluster cannot be started and these tests skip, saying why;
under CI (`CI=true`) that skip is a failure (`tests/ci_skips.py`).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import pytest

from astraflow.config.loader import dump_config, parse_config
from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.slurm import jobs
from astraflow.store.journal import replay
from tests.conftest import REPO

# Short runs on the quickstart task: hf engine, a weak warm-up, fast failure detection.
BASE_SET = ["warmup.steps=5", "trainer.batch_size=64", "trainer.checkpoint_every=10", "engine.kind=hf",
            "dataflow.heartbeat_timeout_s=5", "dataflow.lease_s=10", "launcher.backoff_s=0.5",
            "rollout.concurrency=8"]


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    done = subprocess.run([str(REPO / "tools" / "local-slurm.sh"), "start"], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        pytest.skip(f"no local Slurm cluster (tools/local-slurm.sh start: {done.stderr.strip() or done.stdout.strip()})")


def launch(run_dir: Path, *sets: str, partitions: str = "gpu-h100,gpu-a100") -> str:
    """`astraflow-launch --detach`, as a user runs it; returns the job id."""
    args = [a for s in (*BASE_SET, *sets) for a in ("--set", s)]
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.launch", "--config", "configs/quickstart.yaml",
                          "--partitions", partitions, "--run-dir", str(run_dir), "--detach", *args],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def sbatch_by_hand(run_dir: Path, *sets: str, per_component: tuple[str, ...] = ()) -> str:
    """`sbatch slurm/astraflow_het.sbatch CONFIG` as the README shows, with these settings
    written into CONFIG; `per_component` are sbatch's `OPTS : OPTS : OPTS` overrides."""
    cfg = parse_config((REPO / "configs" / "quickstart.yaml").read_text(), overrides=[*BASE_SET, *sets])
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(dump_config(cfg))
    out = subprocess.run(["sbatch", "--parsable", *per_component, "slurm/astraflow_het.sbatch", str(config)],
                         capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "ASTRAFLOW_RUN_DIR": str(run_dir)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def launch_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "astraflow.cli.launch", *args], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def wait_for(what: str, cond: Callable[[], object], timeout_s: float, run_dir: Path | None = None) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.25)
    logs = ""
    if run_dir is not None and (run_dir / "logs").exists():
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((run_dir / "logs").glob("*")))
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{logs}")


def status(run_dir: Path) -> dict | None:
    try:
        return components.dataflow_status(RunDir.open(run_dir), timeout_s=3)
    except (TimeoutError, FileNotFoundError):
        return None


def trainer_step(run_dir: Path) -> int:
    st = status(run_dir)
    return st["policies"]["policy"]["trainer_step"] if st else -1


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in replay(run_dir / "journal") if e.get("ev") == kind]


def declared_dead(run_dir: Path, worker_base: str) -> tuple[float, int] | None:
    """(epoch seconds, leases handed back) of the rank's log line declaring an incarnation of
    `worker_base` dead, or None before it."""
    log = run_dir / "logs" / "dataflow.log"
    text = log.read_text() if log.exists() else ""
    m = re.search(rf"^(\S+ \S+) dataflow WARNING \S+: worker {re.escape(worker_base)}\.r\d+ silent for \S+: "
                  rf"declared dead, (\d+) leases handed back", text, re.M)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(m.group(2))


def in_queue(job_id: str) -> bool:
    return bool(jobs.squeue([job_id]))


def node_pids(run_dir: Path, procid: int) -> list[int]:
    """The `astraflow node` process of step task `procid` and its component children."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"astraflow.cli.main\0node" in cmd and str(run_dir).encode() in cmd and f"SLURM_PROCID={procid}".encode() in env:
            pids.append(int(d.name))
            pids += [int(c) for c in (d / "task" / d.name / "children").read_text().split()]
    return pids


def acknowledged_commits(run_dir: Path, worker_base: str) -> int:
    """The worker's own ledger: 'commits acknowledged: N' at each exit of its log."""
    text = (run_dir / "logs" / f"rollout-{worker_base}.log").read_text()
    return sum(int(n) for n in re.findall(r"commits acknowledged: (\d+)", text))


def kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture
def cancel_jobs():
    """Cancels every job a test submitted, whatever happens (registered run directories)."""
    runs: list[Path] = []
    yield runs.append
    for run_dir in runs:
        ids = jobs.all_job_ids(run_dir) if run_dir.exists() else []
        subprocess.run(["scancel", *ids], capture_output=True)
