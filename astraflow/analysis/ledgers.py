"""The clients' own ledgers, which `astraflow audit` holds the rank's journal and shards to.

The journal and the shards are written by the dataflow rank, the thing being checked. Each
trainer (its rank 0) appends every acknowledged step to `metrics/<policy>.consumed.jsonl`,
and each rollout worker every acknowledged commit to `logs/acks-<worker>.jsonl`. A journal
deleted mid-run once left the audit ok while the trainer's ledger showed steps 1-60 missing
from the journal and 128 samples trained twice. A run whose clients keep no ledgers has
nothing here to compare; a policy without a trainer ledger is not compared.

Read them before the journal and the shards: on a live run every line of a ledger was
acknowledged, so its step is already in the journal and its samples in a shard. The other
way round only the newest step of a policy may be missing from the trainer's ledger (it
writes the line after the acknowledgement; a trainer killed in between replays the step).

Their writers append whole lines or none (`astraflow/store/appendonly.py`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

LEDGER_SUFFIX = ".consumed.jsonl"
FAILURES_PREFIX = "episode-failures-"  # logs/episode-failures-<worker>.jsonl: episodes lost to an environment or tool


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text(errors="replace").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line: the machine went down mid-write


def read_ledgers(run_dir: Path) -> tuple[dict[str, dict[int, list[int]]], list[dict[str, Any]]]:
    """(policy -> step -> sample ids, the last entry of each step; the stored commits acknowledged)."""
    trainer: dict[str, dict[int, list[int]]] = {}
    for path in sorted((run_dir / "metrics").glob(f"*{LEDGER_SUFFIX}")):
        steps = trainer.setdefault(path.name[: -len(LEDGER_SUFFIX)], {})
        for entry in _lines(path):
            steps[int(entry["step"])] = [int(s) for s in entry["ids"]]  # a replayed step: the last counts
    acks = [a for path in sorted((run_dir / "logs").glob("acks-*.jsonl")) for a in _lines(path)
            if a.get("status") == "stored"]
    return trainer, acks


def episode_failures(run_dir: Path) -> dict[str, int]:
    """Episodes the workers handed back after an environment or tool failure, by kind."""
    counts: dict[str, int] = {}
    for path in sorted((run_dir / "logs").glob(f"{FAILURES_PREFIX}*.jsonl")):
        for entry in _lines(path):
            counts[str(entry.get("kind"))] = counts.get(str(entry.get("kind")), 0) + 1
    return counts


def cross_check(trainer: dict[str, dict[int, list[int]]], acks: list[dict[str, Any]],
                journal: dict[tuple[str, int], list[int]], stored: set[int], committed_tasks: set[int]) -> dict:
    """Where the ledgers and the journal or shards disagree; all counts 0 when they agree."""
    missing = [(p, s) for p, steps in trainer.items() for s in sorted(steps) if (p, s) not in journal]
    differing = [(p, s) for p, steps in trainer.items() for s, ids in sorted(steps.items())
                 if (p, s) in journal and journal[(p, s)] != ids]
    newest = {p: max(s for q, s in journal if q == p) for p, _ in journal}
    unledgered = [(p, s) for p, s in sorted(journal) if p in trainer and s not in trainer[p] and s != newest[p]]
    twice = sum(len(ids) - len(set(ids)) for ids in
                ([s for step in steps.values() for s in step] for steps in trainer.values()))
    lost = 0
    for ack in acks:
        gone = [s for s in ack["sids"] if s not in stored]
        # all of a commit gone and its task committed again: regenerated; part of it gone, or
        # its task never committed again: acknowledged and lost
        if gone and (len(gone) < len(ack["sids"]) or ack["task"] not in committed_tasks):
            lost += len(gone)
    return {"trainer_steps": sum(map(len, trainer.values())), "steps_missing_from_journal": len(missing),
            "steps_differing": len(differing), "steps_missing_from_ledger": len(unledgered),
            "trained_twice": twice, "acked_commits": len(acks), "acked_not_stored": lost,
            "examples": {"steps_missing_from_journal": missing[:10], "steps_differing": differing[:10],
                         "steps_missing_from_ledger": unledgered[:10]}}


def agree(report: dict) -> bool:
    return not any(report[k] for k in ("steps_missing_from_journal", "steps_differing", "steps_missing_from_ledger",
                                       "trained_twice", "acked_not_stored"))
