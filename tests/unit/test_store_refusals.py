"""Stored data that the run's config (or this code) no longer describes is refused, never
quarantined: the rank's recovery raises `StoreRefused` naming the file, what it stores and
what the config says, and moves nothing, so restoring the config brings everything back.

Before: a policy renamed in an existing run's config.yaml quarantined every shard, then the
rank crashed with KeyError on the journal; restoring the config did not bring the data back
(audit: every task lost)."""
from __future__ import annotations

from pathlib import Path

import h5py
import pytest

from astraflow.analysis.audit import audit
from astraflow.config.rundir import RunDir
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from astraflow.store.errors import StoreRefused
from astraflow.store.writer import list_shards
from tests.conftest import make_run, trained_run_dir


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under shards/ and journal/, with its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for d in ("shards", "journal")
            for p in sorted((run_dir / d).rglob("*")) if p.is_file()}


def rename_policy(run_dir: Path, old: str, new: str) -> None:
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace(f"- name: {old}\n", f"- name: {new}\n"))


def recover(run_dir: Path) -> DataflowState:
    state = DataflowState(run_dir, RunDir.open(run_dir).config, clock=lambda: 1000.0)
    try:
        state.recover()
    except BaseException:
        state.close()
        raise
    return state


def test_a_policy_renamed_in_the_config_is_refused_and_restoring_the_config_brings_the_run_back(tmp_path):
    run_dir = trained_run_dir(tmp_path)
    (shard,) = list_shards(run_dir / "shards")
    before = snapshot(run_dir)
    rename_policy(run_dir, "policy", "solver")
    with pytest.raises(StoreRefused) as refused:
        recover(run_dir)
    message = str(refused.value)
    assert "\n" not in message and str(shard) in message
    assert "stores policies ['policy'] but the run's config names ['solver']" in message
    assert snapshot(run_dir) == before  # nothing moved, nothing written
    rename_policy(run_dir, "solver", "policy")
    state = recover(run_dir)
    assert len(state.tasks.done) == 8 and not state.store.quarantined
    state.close()
    assert audit(run_dir)["ok"]


def test_a_journal_naming_a_policy_the_config_lacks_is_refused(tmp_path):
    """No shard yet, but the journal already names the policy (its trainer registered)."""
    run = make_run(tmp_path)
    state = recover(run.path)
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    state.flush()
    state.close()
    before = snapshot(run.path)
    rename_policy(run.path, "policy", "solver")
    with pytest.raises(StoreRefused, match=r"names policy 'policy' \(a 'ready' event\) but the run's config names "
                                           r"\['solver'\]"):
        recover(run.path)
    assert snapshot(run.path) == before


def test_a_shard_of_a_newer_schema_is_refused_not_quarantined(tmp_path):
    run_dir = trained_run_dir(tmp_path)
    (shard,) = list_shards(run_dir / "shards")
    with h5py.File(shard, "r+") as f:
        f.attrs["schema_version"] = 99
    before = snapshot(run_dir)
    with pytest.raises(StoreRefused, match=r"schema_version 99, this code reads \[1, 2, 3\]"):
        recover(run_dir)
    assert snapshot(run_dir) == before
