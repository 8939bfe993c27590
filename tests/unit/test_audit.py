"""`astraflow audit` on a real run directory written by the dataflow rank's state machine:
ok as written; not ok once a duplicate record is injected or a trained record deleted, or
when the clients' own ledgers disagree with the journal and the shards."""
from __future__ import annotations

import json
import shutil

import h5py

from astraflow.analysis.audit import audit, lineage
from astraflow.config.rundir import RunDir
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from astraflow.store.reader import load_rows
from astraflow.store.writer import list_shards


def test_audit_of_an_intact_run_is_ok(trained_run):
    report = audit(trained_run)
    assert report["ok"] and report["tasks"] == 8 and report["committed"] == 32
    assert report["trained"] == {"policy": 32} and report["duplicates"] == report["lost"] == 0


def test_an_injected_duplicate_record_is_reported(trained_run):
    (shard,) = list_shards(trained_run / "shards")
    shutil.copy(shard, shard.with_name("shard-000009.h5"))  # every record stored a second time
    report = audit(trained_run)
    assert not report["ok"] and report["duplicates"] >= 32


def test_a_deleted_trained_record_is_reported_lost(trained_run):
    (shard,) = list_shards(trained_run / "shards")
    with h5py.File(shard, "r+", libver="latest") as f:
        f["rows"].resize((f["rows"].shape[0] - 1,))  # the last record disappears
    report = audit(trained_run)
    assert not report["ok"] and report["lost"] == 1


def test_a_sample_trained_in_two_steps_is_reported(trained_run):
    journal = trained_run / "journal" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    step1 = next(line for line in lines if '"consumed"' in line and '"step":1' in line.replace(" ", ""))
    journal.write_text("\n".join(lines + [step1.replace('"step": 1', '"step": 3').replace('"step":1', '"step":3')]) + "\n")
    report = audit(trained_run)
    assert not report["ok"] and report["trained_twice"] == 16


def test_rows_of_zeros_left_by_a_write_cut_short_are_neither_records_nor_duplicates(trained_run, caplog):
    """ENOSPC inside HDF5 extended the row table over 8 rows it never wrote (zeros): recovery
    had taken them for 8 more copies of sample 0, and audit counted 9 duplicates."""
    (shard,) = list_shards(trained_run / "shards")
    with h5py.File(shard, "r+", libver="latest") as f:
        f["rows"].resize((f["rows"].shape[0] + 8,))
    report = audit(trained_run)
    assert report["ok"] and report["duplicates"] == 0 and report["committed"] == 32
    assert report["torn_rows"] == {shard.name: 8}
    state = DataflowState(trained_run, RunDir.open(trained_run).config, clock=lambda: 1000.0)
    state.recover()
    status = state.handle(m.Status()).status
    assert status["store"]["torn_rows"] == {shard.name: 8} and not status["store"]["quarantined"]
    assert status["tasks"]["done"] == 8 and status["policies"]["policy"]["stored"] == 32
    assert "its last 8 rows point at nothing" in caplog.text
    state.close()


def write_ledgers(run_dir):
    """The ledgers the trainer and the worker would have written for this run."""
    (run_dir / "metrics").mkdir(exist_ok=True)
    with open(run_dir / "metrics" / "policy.consumed.jsonl", "w") as f:
        for (_, step), ev in sorted(lineage(run_dir).items()):
            f.write(json.dumps({"step": step, "ids": ev["ids"]}) + "\n")
    df = load_rows(run_dir)
    with open(run_dir / "logs" / "acks-w.jsonl", "w") as f:
        for task, g in df.groupby("task_id"):
            f.write(json.dumps({"task": int(task), "status": "stored", "sids": g["sample_id"].tolist()}) + "\n")


def test_the_clients_ledgers_agreeing_with_the_journal_and_shards_audit_ok(trained_run):
    write_ledgers(trained_run)
    report = audit(trained_run)
    assert report["ok"] and report["ledgers"]["trainer_steps"] == 2 and report["ledgers"]["acked_commits"] == 8


def test_a_journal_that_lost_trained_steps_is_caught_by_the_trainers_ledger(trained_run):
    """The journal deleted mid-run and begun afresh: the shards and the new journal agree with
    each other, and only the trainer's ledger remembers step 1 (and that its samples were
    trained again at step 3)."""
    write_ledgers(trained_run)
    ledger = trained_run / "metrics" / "policy.consumed.jsonl"
    step1 = json.loads(ledger.read_text().splitlines()[0])
    with open(ledger, "a") as f:
        f.write(json.dumps({"step": 3, "ids": step1["ids"]}) + "\n")
    journal = trained_run / "journal" / "journal.jsonl"
    journal.write_text("".join(line + "\n" for line in journal.read_text().splitlines()
                               if '"ev":"consumed"' not in line or '"step":2' in line))
    report = audit(trained_run)
    led = report["ledgers"]
    assert report["trained_twice"] == 0  # the journal alone sees nothing wrong
    assert not report["ok"] and led["steps_missing_from_journal"] == 2 and led["trained_twice"] == 16
    assert led["examples"]["steps_missing_from_journal"] == [("policy", 1), ("policy", 3)]


def test_an_acknowledged_commit_missing_from_the_shards_is_caught_by_the_workers_ledger(trained_run):
    write_ledgers(trained_run)
    with open(trained_run / "logs" / "acks-w.jsonl", "a") as f:  # acknowledged, then lost with a vanished shard
        f.write(json.dumps({"task": 99, "status": "stored", "sids": [1000, 1001, 1002, 1003]}) + "\n")
    report = audit(trained_run)
    assert not report["ok"] and report["ledgers"]["acked_not_stored"] == 4
