"""A chaos run: `astraflow run` on a task the tiny model learns in seconds, plus the
independent ledgers the tests compare with `astraflow audit`.

The ledgers are the clients' own records: every worker's acknowledged commits
(`logs/acks-<worker>.jsonl`) and every trainer's acknowledged steps
(`metrics/<policy>.consumed.jsonl`). They are written by the workers and trainers, not by the
dataflow rank, whose journal and shards are what is being checked.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path


from astraflow.analysis.audit import audit, lineage
from astraflow.analysis.metrics import read_metrics
from astraflow.store.reader import load_rows
from tests.conftest import REPO, parity_prompts

BATCH = 64
# groups of 8 and batches of 64, as in tests/integration/test_local_run.py: with groups of 4
# and batches of 32 the policy collapsed to one answer per prompt, every group had zero
# advantage and the trainer starved (a run went from 20 s to 90 s per step)
# a short warm-up teaches the answer format: from a random init every group scores 0, all are
# filtered, and the first step waited up to 50 s
BASE = [f"trainer.batch_size={BATCH}", "trainer.checkpoint_every=3", "trainer.lr=0.003", "warmup.steps=20",
        "tasks.warmup=100", "tasks.kind=jsonl", "engine.max_tokens=3", "engine.kind=hf",
        "launcher.backoff_s=0.2", "launcher.max_restarts=10", "dataflow.heartbeat_timeout_s=3",
        "dataflow.lease_s=4", "rollout.workers=2", "rollout.concurrency=8",
        # every group trainable: these runs test what happens to data, and a policy that has
        # learned parity makes every group all-correct; filtered, they starved the trainer
        # (a CI run stalled at step 23 of 30 for 5 minutes)
        "policies.policy.filter_zero_advantage=false"]


def start(tmp_path: Path, steps: int, extra: list[str] = (), run_dir: Path | None = None) -> tuple[subprocess.Popen, Path]:
    run_dir = run_dir or tmp_path / "run"
    overrides = [*BASE, f"trainer.steps={steps}", f"tasks.path={parity_prompts(tmp_path / 'parity.jsonl')}", *extra]
    proc = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "run", "configs/quickstart.yaml",
                             "--run-dir", str(run_dir), "--quiet", "--json",  # the summary as one line of JSON
                             *[a for o in overrides for a in ("--set", o)]],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, run_dir


def resume(run_dir: Path) -> subprocess.Popen:
    """`astraflow run --run-dir RUN`: carry on from the run directory, with its own config."""
    return subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "run", "--run-dir", str(run_dir), "--quiet",
                             "--json"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_done(run_dir: Path) -> int:
    rows = read_metrics(run_dir, "policy")
    return int(rows[-1]["step"]) if rows else 0


def wait_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while steps_done(run_dir) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no step {n} within {timeout_s}s\n{diagnosis(run_dir)}"
        time.sleep(0.1)


def finish(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # stop it the way a user would, then for sure
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # its components die with it (PR_SET_PDEATHSIG)
        run_dir = Path(proc.args[proc.args.index("--run-dir") + 1])
        raise AssertionError(f"the run did not finish within {timeout_s}s\n{diagnosis(run_dir)}") from None


def run_fails_after(proc: subprocess.Popen, run_dir: Path, steps: int, damage, timeout_s: float) -> str:
    """Wait for `steps` metric rows, call `damage()`, and let the run fail: the launcher's
    failure message, which names the component and then quotes its log's last error."""
    try:
        wait_steps(proc, run_dir, steps)
        damage()
        _, err = finish(proc, timeout_s=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err[-3000:]
    return err[err.rindex("astraflow run:"):]


def diagnosis(run_dir: Path, lines: int = 12) -> str:
    """The tails of a run's logs and its last metrics: what a failed chaos test reports."""
    last = [{k: r[k] for k in ("step", "reward_mean", "generated", "wait_s")} for r in read_metrics(run_dir, "policy")[-3:]]
    parts = [f"--- last steps: {last}"]
    for log in sorted((run_dir / "logs").glob("*.log")):
        parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(parts)


def check_ledgers_and_audit(run_dir: Path, lost_shards: bool = False) -> dict:
    """audit says ok, and the clients' own ledgers agree with the shards and the journal.

    With `lost_shards` (a test damaged a shard on purpose) an acknowledged trajectory may be
    gone, but then its task must have been committed again."""
    report = audit(run_dir)
    assert report["ok"], report
    df = load_rows(run_dir)
    stored, tasks = set(df["sample_id"]), set(df["task_id"])
    acked = [json.loads(line) for p in (run_dir / "logs").glob("acks-*.jsonl") for line in p.read_text().splitlines()]
    gone = [a["task"] for a in acked if a["status"] == "stored" and not set(a["sids"]) <= stored]
    assert acked and (not gone if not lost_shards else set(gone) <= tasks), f"acknowledged, not stored: {gone[:10]}"
    trainer: dict[int, list[int]] = {}
    for line in (run_dir / "metrics" / "policy.consumed.jsonl").read_text().splitlines():
        entry = json.loads(line)
        trainer[entry["step"]] = entry["ids"]  # a replayed step after a restart: the last one counts
    journal = {step: ev["ids"] for (policy, step), ev in lineage(run_dir).items()}
    assert trainer == journal, "the trainer's ledger and the rank's journal disagree"
    return report
