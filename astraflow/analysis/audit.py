"""`astraflow audit RUN_DIR`: the exactly-once promises, checked from the shards and journal.

- every task committed at most once: a commit is one (task, worker, commit time) in the row
  table; a second commit of a task, or a sample id stored twice, is a duplicate;
- every trajectory a trainer acknowledged is in a live shard, or its shard was quarantined
  (then its tasks must have been committed again: `regenerated`); a consumed sample found
  nowhere is `lost`, and so is a quarantined task that was never committed again;
- no sample trained twice in the surviving lineage: for each (policy, step) the last
  `consumed` event counts (a replayed step after a trainer restart replaces the first), and
  no sample id may appear in two steps. AstraFlow has no replay of old samples, so any
  repeat is an error;
- the clients' own ledgers agree (ledgers.py): every step a trainer acknowledged is in the
  journal with the same samples, none twice, and every commit a worker had acknowledged is
  stored or was committed again.

Reads files only; safe on a live run (a commit may then be on its way and not yet visible).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from astraflow.analysis.ledgers import agree, cross_check, read_ledgers
from astraflow.store.errors import StoreRefused
from astraflow.store.journal import replay
from astraflow.store.reader import ShardCorrupt, ShardReader, load_rows


def _quarantined_tasks(run_dir: Path) -> tuple[set[int], set[int], list[str]]:
    """Task and sample ids of quarantined shards that can still be read, and those that cannot."""
    tasks: set[int] = set()
    samples: set[int] = set()
    unreadable = []
    for path in sorted((run_dir / "shards" / "quarantine").glob("*.h5")):
        try:
            reader = ShardReader(path, writer_alive=False)  # nothing writes a quarantined shard
            rows = reader.rows(("task_id", "sample_id"))
            reader.close()
        except (ShardCorrupt, StoreRefused):
            unreadable.append(path.name)
            continue
        tasks.update(int(t) for t in rows["task_id"])
        samples.update(int(s) for s in rows["sample_id"])
    return tasks, samples, unreadable


def lineage(run_dir: Path) -> dict[tuple[str, int], dict]:
    """(policy, step) -> the last `consumed` event for it (sample ids and their task ids)."""
    out: dict[tuple[str, int], dict] = {}
    for ev in replay(run_dir / "journal"):
        if ev.get("ev") == "consumed":
            out[(ev["policy"], ev["step"])] = ev
    return out


def audit(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    trainer_ledgers, acks = read_ledgers(run_dir)  # before the journal and the shards: see ledgers.py
    df = load_rows(run_dir, verify=True)  # a shard whose data cannot be found has lost it
    commits = df.groupby(["task_id", "worker", "t_commit"]).size().groupby("task_id").size()
    duplicate_commits = int((commits - 1).sum())
    duplicate_samples = int(df["sample_id"].duplicated().sum())
    stored = set(df["sample_id"].tolist())
    q_tasks, q_samples, unreadable = _quarantined_tasks(run_dir)
    committed_tasks = set(df["task_id"].tolist())
    trained: dict[str, list[int]] = {}
    task_of: dict[int, int] = {}
    journal_lineage = lineage(run_dir)
    for (policy, _), ev in journal_lineage.items():
        trained.setdefault(policy, []).extend(ev["ids"])
        task_of.update(zip(ev["ids"], ev.get("tasks", [])))
    trained_twice = sum(len(ids) - len(set(ids)) for ids in trained.values())
    missing = {s for ids in trained.values() for s in ids} - stored - q_samples
    # A trained sample whose record is gone is not lost if its task was committed again by a
    # later incarnation of the rank (sample ids are never reused: each incarnation starts
    # above every id handed out before). A row of the task from the sample's own incarnation
    # means its commit survives, and the record was deleted out of it: lost.
    starts = sorted(ev["first_sample"] for ev in replay(run_dir / "journal")
                    if ev.get("ev") == "start" and "first_sample" in ev)
    first_live = df.groupby("task_id")["sample_id"].min().to_dict()

    def regenerated(s: int) -> bool:
        t = task_of.get(s)
        later = next((b for b in starts if b > s), None)
        return t in first_live and later is not None and first_live[t] >= later

    regenerated_tasks = {task_of[s] for s in missing if regenerated(s)}
    lost_samples = sorted(s for s in missing if task_of.get(s) not in regenerated_tasks)
    gone_tasks = q_tasks | regenerated_tasks
    unregenerated = sorted(q_tasks - committed_tasks)
    report = {
        "tasks": len(committed_tasks),
        "committed": int(len(df)),
        "duplicates": duplicate_commits + duplicate_samples,
        "lost": len(lost_samples) + len(unregenerated),
        "regenerated": len(gone_tasks & committed_tasks),
        "trained_twice": int(trained_twice),
        "trained": {p: len(ids) for p, ids in trained.items()},
        "quarantined_shards": len(list((run_dir / "shards" / "quarantine").glob("*.h5"))),
        "unreadable_quarantined": unreadable,
        "unreadable_shards": list(df.attrs.get("skipped", [])),
        "torn_rows": dict(df.attrs.get("torn", {})),  # never acknowledged: not records, not a fault
        "examples": {"lost_samples": lost_samples[:10], "unregenerated_tasks": unregenerated[:10],
                     "duplicate_tasks": [int(t) for t in np.asarray(commits[commits > 1].index)[:10]]},
    }
    report["ledgers"] = cross_check(trainer_ledgers, acks, {k: ev["ids"] for k, ev in journal_lineage.items()},
                                    stored, committed_tasks)
    report["ok"] = (report["duplicates"] == 0 and report["lost"] == 0 and report["trained_twice"] == 0
                    and not report["unreadable_shards"] and agree(report["ledgers"]))
    return {"ok": report.pop("ok"), **report}


def format_audit(report: dict) -> str:
    verdict = "ok" if report["ok"] else "NOT OK"
    lines = [f"audit: {verdict}",
             f"  tasks committed {report['tasks']}, trajectories {report['committed']}, trained {report['trained']}",
             f"  duplicates {report['duplicates']}, lost {report['lost']}, regenerated {report['regenerated']}, "
             f"trained twice {report['trained_twice']}, quarantined shards {report['quarantined_shards']}"]
    lines += [f"  {k}: {v}" for k, v in report["examples"].items() if v]
    lines += [f"  unreadable shard: {s}" for s in report["unreadable_shards"]]
    lines += [f"  torn tail ignored: {n} rows of {s}" for s, n in report["torn_rows"].items()]
    led = report["ledgers"]
    if led["trainer_steps"] or led["acked_commits"]:
        lines.append(f"  clients' ledgers: {led['trainer_steps']} trainer steps ({led['steps_missing_from_journal']} "
                     f"missing from the journal, {led['steps_differing']} differing, "
                     f"{led['steps_missing_from_ledger']} journalled but not in the ledger, {led['trained_twice']} "
                     f"samples trained twice); {led['acked_commits']} acknowledged commits "
                     f"({led['acked_not_stored']} samples not stored)")
        lines += [f"    {k}: {v}" for k, v in led["examples"].items() if v]
    return "\n".join(lines)
