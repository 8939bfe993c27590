"""Recovery resumed from the compact state equals a full replay (dataflow/recovery.py, compact.py).

A run with two policies, filtered groups, many shards, consumed steps, a published version
and a trainer restart is compacted part-way while its rank is live; it then goes on (more
commits into new shards, more steps, a served step not yet acknowledged). A restart from the
compact state must hold exactly what a restart replaying everything holds, and must not read
the shards the compact state covers. Where the compact state no longer describes the run (a
journal replaced, a covered shard found damaged, other policy settings) it is not used, and
recovery is still exact.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from astraflow.config.loader import load_config
from astraflow.dataflow import recovery
from astraflow.dataflow.compact import Compaction, compact
from astraflow.dataflow.recovery import COMPACT_STATE
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from tests.conftest import DataflowProcess, client, make_run
from tests.unit.test_recovery_equals_live import CONFIG, commit, snapshot


def work(state: DataflowState, worker: str, rng: np.random.Generator, tasks: int, steps: range) -> None:
    """Commit `tasks` tasks, then consume `steps` of both policies."""
    for task in state.handle(m.Lease(worker, tasks)).tasks:
        commit(state, worker, task.task_id, rng)
    for policy in ("solver", "verifier"):
        for step in steps:
            batch = state.handle(m.Batch(policy, step, 12))
            state.handle(m.Consumed(policy, step, batch.sample_ids.tolist()))
    state.flush()


def full_state(state: DataflowState) -> dict:
    """Everything recovery rebuilds, beyond the sample table and buffers of `snapshot`."""
    return {**snapshot(state), "incarnation": state.incarnation, "next_sample_id": state.next_sample_id,
            "sample_hwm": state.sample_hwm, "task_hwm": state.task_hwm, "lost": state.lost_samples,
            "queued": list(state.tasks.queued), "restarts": dict(state.workers.restarts),
            "weights": {p: sorted(w.versions) for p, w in state.weights.policies.items()},
            "quarantined": len(state.store.quarantined), "streaks": dict(state.selection.streak)}


@pytest.fixture(params=[False, True], ids=["selection-off", "selection-on"])
def compacted(tmp_path, request):
    """A run compacted part-way and gone on since; its rank stopped (its restart is the test)."""
    run = make_run(tmp_path, [f"selection.skip_zero_advantage={str(request.param).lower()}",
                              "dataflow.compact_every_s=0.5"], config=CONFIG)
    state = DataflowState(run.path, run.config)
    state.recover()
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["solver", "verifier"], 64)).worker_id
    rng = np.random.default_rng(1)
    for policy in ("solver", "verifier"):
        state.handle(m.Ready(m.PROTOCOL_VERSION, policy, 0))
    work(state, worker, rng, 30, range(1, 3))
    state.handle(m.Published("solver", 1, "file:///weights/solver-1", []))
    state.flush()
    fold = compact(run.path, run.config)  # beside the live rank
    assert len(fold.rows_covered) >= 2 and fold.journal_bytes > 0
    work(state, worker, rng, 30, range(3, 5))
    state.handle(m.Ready(m.PROTOCOL_VERSION, "solver", 3))  # a trainer restart: step 4 is served again
    state.handle(m.Batch("solver", 5, 12))  # served, not acknowledged
    state.flush()
    state.close()
    return run, fold


def restart(run_dir: Path, cfg) -> DataflowState:
    state = DataflowState(run_dir, cfg)
    state.recover()
    state.close()
    return state


def replayed_copy(run, tmp_path: Path) -> dict:
    """What a restart replaying everything rebuilds: on a copy of the run without the compact state."""
    copy = tmp_path / "copy"
    shutil.copytree(run.path, copy)
    (copy / "journal" / COMPACT_STATE).unlink(missing_ok=True)
    state = restart(copy, run.config)
    assert not state.compact_used
    return full_state(state)


def test_recovery_from_the_compact_state_equals_a_full_replay_and_skips_what_it_covers(compacted, tmp_path,
                                                                                       monkeypatch):
    run, fold = compacted
    expected = replayed_copy(run, tmp_path)
    read: dict[str, int] = {}
    fold_shard = recovery.Fold.fold_shard

    def spy(self, name, idx, names, rows):
        read[name] = len(rows["sample_id"])
        fold_shard(self, name, idx, names, rows)

    monkeypatch.setattr(recovery.Fold, "fold_shard", spy)
    state = restart(run.path, run.config)
    assert state.compact_used
    assert full_state(state) == expected
    assert expected["lost"] == 0 and expected["buffers"]["solver"][2]  # a served step came back
    assert bool(expected["streaks"]) == run.config.selection.skip_zero_advantage
    assert read and not read.keys() & fold.rows_covered.keys()  # only the shards written since were read


def test_a_replaced_journal_is_replayed_whole(compacted, tmp_path):
    run, _ = compacted
    expected = replayed_copy(run, tmp_path)
    journal = run.path / "journal" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "time": first["time"] + 1.0}, separators=(",", ":"))  # one byte or more differ
    journal.write_text("\n".join(lines) + "\n")
    state = restart(run.path, run.config)
    assert not state.compact_used
    assert full_state(state) == expected


def test_a_covered_shard_found_damaged_since_is_quarantined_and_everything_replayed(compacted, tmp_path):
    run, fold = compacted
    victim = sorted(fold.rows_covered)[1]
    with open(run.path / "journal" / "journal.jsonl", "a") as f:  # as the rank journals a failed read-back
        f.write(json.dumps({"ev": "damaged", "shard": victim, "why": "test"}) + "\n")
    expected = replayed_copy(run, tmp_path)
    assert expected["quarantined"] == 1
    state = restart(run.path, run.config)
    assert not state.compact_used
    assert full_state(state) == expected
    assert (run.path / "shards" / "quarantine" / victim).exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_compact_state_is_not_used(compacted, tmp_path, damage):
    run, _ = compacted
    expected = replayed_copy(run, tmp_path)
    path = run.path / "journal" / COMPACT_STATE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x93NUMPY" + bytes(range(256)) * 8)
    state = restart(run.path, run.config)
    assert not state.compact_used
    assert full_state(state) == expected


def test_a_compact_state_made_under_other_policy_settings_is_not_used(compacted, tmp_path):
    run, _ = compacted
    other = load_config(run.path / "config.yaml", ["policies.verifier.advantage_std=true"])
    state = restart(run.path, other)
    assert not state.compact_used


def test_the_rank_starts_a_compaction_process_while_the_journal_grows(compacted):
    run, _ = compacted
    state_file = run.path / "journal" / COMPACT_STATE
    state_file.unlink()
    now = [0.0]
    compaction = Compaction(run.path, 10.0, clock=lambda: now[0])
    compaction.poll()
    assert compaction.proc is None  # not yet due
    now[0] = 11.0
    compaction.poll()
    assert compaction.proc is not None
    assert compaction.proc.wait(timeout=120) == 0
    compaction.poll()
    assert compaction.done == 1 and state_file.exists()
    now[0] = 22.0
    compaction.poll()
    assert compaction.proc is None  # the journal has not grown: nothing to fold
    restarted = DataflowState(run.path, run.config)
    restarted.recover()
    assert restarted.compact_used
    restarted.close()


def test_the_compaction_command_names_what_it_could_not_read(compacted):
    run, fold = compacted
    victim = run.path / "shards" / sorted(fold.rows_covered)[0]
    (run.path / "journal" / COMPACT_STATE).unlink()
    victim.write_bytes(b"\0" * 64)
    done = subprocess.run([sys.executable, "-m", "astraflow.dataflow.compact", str(run.path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert "no compact state written" in done.stderr and victim.name in done.stderr
    assert not (run.path / "journal" / COMPACT_STATE).exists()


def test_a_live_rank_compacts_and_its_restart_after_sigkill_resumes_from_it(compacted):
    run, _ = compacted
    state_file = run.path / "journal" / COMPACT_STATE
    state_file.unlink()
    rank = DataflowProcess(run)
    rank.start()
    try:
        deadline = time.monotonic() + 60
        while not state_file.exists():  # its start journalled a line: the journal grew
            assert time.monotonic() < deadline, rank.log.read_text()
            time.sleep(0.1)
        rank.kill()
        rank.start()
        status = client(run).call(m.Status()).status
        assert status["store"]["recovery"]["from_compact_state"], rank.log.read_text()
        assert status["policies"]["solver"]["consumed"] > 0
    finally:
        rank.stop()
