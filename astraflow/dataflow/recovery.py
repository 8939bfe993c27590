"""What the dataflow rank's recovery learns from the shards and the journal, as a fold that
can be saved (the compact state) and resumed, so that a restart reads only what came after.

`Fold` holds everything recovery learns before the state machine takes it over
(`DataflowState.recover` installs it): the sample table (READY or FILTERED as stored), the
committed tasks, per policy the guided count, the trainer's step, the served and consumed
ledgers (the raw ids the journal names) and how many samples were served, and the journal's
incarnation, id high-water marks, worker restart counters, published weight versions and
damaged shards. Two folds make it, independent of each other:
- rows (`fold_rows`): every good row of every shard, in any order: a row is put at its
  sample id, the task set and counts are unions and sums. A group's advantage needs the
  whole group, so rows are folded a shard at a time, and a shard only once it is never
  written again (a task's rows are consecutive in one shard: writer.py);
- events (`fold_event`): the journal's lines in order. No event is folded against the
  sample table: which of a ledger's ids are still stored (a lost shard takes its samples
  along) is decided when the fold is installed (`resolve`), after every row is in.
So a fold of some shards and a prefix of the journal, resumed with the other shards and the
rest of the journal, equals a fold of everything: recovery from the compact state equals a
full replay (tests/dataflow/test_compact_state.py).

The compact state (`RUN_DIR/journal/compact-state.npz`: numpy arrays and one JSON header,
no pickle) is a fold with how far it got: the good rows of each shard it covers and the
byte length and CRC-32 of the journal prefix it read. It is written by `compact.py` in a
process of its own, and never after `resolve` (which sets ledger states in the table).
Recovery uses it only if it still describes the run: the same format and policy settings,
the journal prefix unchanged (`Fold.why_stale`), and every shard it covers still there,
not found damaged, with the same number of good rows; otherwise recovery replays everything
and says why.
"""
from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from astraflow.config.schema import Config
from astraflow.dataflow.buffers import CONSUMED, FILTERED, READY, SERVED, grouped_stats
from astraflow.dataflow.leases import TaskSet
from astraflow.dataflow.samples import COLUMNS, SampleTable

FORMAT = 1  # of the compact state's file; another one is not read (a full replay is done)
COMPACT_STATE = "compact-state.npz"  # in RUN_DIR/journal/
RECOVERY_COLUMNS = ("sample_id", "task_id", "policy", "version_min", "reward", "guided", "length")
RECOVERY_SLICE_ROWS = 1 << 19  # rows folded at a time (the arithmetic holds ~100 bytes a row)


def settings_of(cfg: Config) -> dict[str, Any]:
    """What the rows' fold reads from the config: a compact state made under other settings
    holds other advantages or filter decisions, and is not used."""
    return {"policies": [[p.name, p.filter_zero_advantage, p.advantage_std] for p in cfg.policies],
            "selection": bool(cfg.selection.skip_zero_advantage)}


class Fold:
    """Recovery's state while it is built: see the module's docstring."""

    def __init__(self, cfg: Config) -> None:
        self.policy_names = cfg.policy_names
        self.policy_index = {p: i for i, p in enumerate(self.policy_names)}
        n = len(self.policy_names)
        self.advantage_std = np.array([p.advantage_std for p in cfg.policies])
        self.filter_zero = np.array([p.filter_zero_advantage for p in cfg.policies])
        self.selection_on = bool(cfg.selection.skip_zero_advantage)
        self.settings = settings_of(cfg)
        # rows
        self.samples = SampleTable()
        self.done = TaskSet()
        self.uninformative: dict[int, bool] = {}  # task -> every group it produced was filtered (selection)
        self.guided = np.zeros(n, np.int64)
        self.next_sample_id = 0
        self.rows_covered: dict[str, int] = {}  # shard name -> good rows folded (all of them)
        # events
        self.incarnation = 0
        self.first_start: dict[str, Any] | None = None
        self.stranger: dict[str, Any] | None = None  # the first event naming a policy not in the config
        self.damaged: dict[str, str] = {}  # shard name -> why (found unreadable while serving)
        self.sample_hwm = 0
        self.task_hwm = 0
        self.restarts: dict[str, int] = {}
        self.published: list[dict[str, Any]] = []
        self.trainer_step = [0] * n
        self.served_count = np.zeros(n, np.int64)
        self.served: list[dict[int, np.ndarray]] = [{} for _ in range(n)]  # step -> ids, not yet consumed
        self.consumed: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        self.journal_bytes = 0  # of the journal folded (whole lines)
        self.journal_crc = 0  # CRC-32 of those bytes

    # ------------------------------------------------------------------ rows
    def fold_shard(self, name: str, idx: int, shard_policies: tuple[str, ...], rows: dict[str, np.ndarray]) -> None:
        """A shard's good rows, all of them, in slices of whole tasks to bound the memory of the arithmetic."""
        tids = rows["task_id"]
        lo = 0
        while lo < len(tids):
            hi = min(len(tids), lo + RECOVERY_SLICE_ROWS)
            while hi < len(tids) and tids[hi] == tids[hi - 1]:
                hi += 1
            self.fold_rows(idx, lo, shard_policies, {c: v[lo:hi] for c, v in rows.items()})
            lo = hi
        self.rows_covered[name] = len(tids)

    def fold_rows(self, idx: int, first_row: int, names: tuple[str, ...], rows: dict[str, np.ndarray]) -> None:
        """Consecutive rows of shard `idx`, from `first_row`, holding whole tasks: their samples
        into the table, with their groups' advantages (a group: a task's samples of one policy)."""
        n = len(rows["sample_id"])
        if not n:
            return
        to_run = np.array([self.policy_index[name] for name in names], np.int8)
        policy = to_run[rows["policy"]]
        order = np.lexsort((policy, rows["task_id"]))  # stable: a group's rows stay in commit order
        tids, pols = rows["task_id"][order], policy[order]
        first = np.ones(n, bool)
        first[1:] = (tids[1:] != tids[:-1]) | (pols[1:] != pols[:-1])
        starts = np.flatnonzero(first)
        sizes = np.diff(np.append(starts, n))
        group_policy = pols[starts]
        mean, std, adv = grouped_stats(rows["reward"][order], starts, self.advantage_std[group_policy])
        filtered = self.filter_zero[group_policy] & (sizes > 1) & (std == 0.0)
        sids = rows["sample_id"][order]
        self.samples.put(sids, policy=pols, state=np.where(np.repeat(filtered, sizes), FILTERED, READY), task_id=tids,
                         version_min=rows["version_min"][order], advantage=adv, group_mean=np.repeat(mean, sizes),
                         group_std=np.repeat(std, sizes), shard=idx, row=first_row + order,
                         tokens=rows["length"][order])
        self.guided += np.bincount(policy, weights=rows["guided"], minlength=len(self.policy_names)).astype(np.int64)
        self.done.add_many(np.unique(tids))
        self.next_sample_id = max(self.next_sample_id, int(sids.max()) + 1)
        if self.selection_on:
            task_first = np.flatnonzero(np.append(True, tids[starts][1:] != tids[starts][:-1]))
            for tid, zero in zip(tids[starts][task_first].tolist(),
                                 np.logical_and.reduceat(filtered, task_first).tolist()):
                self.uninformative[tid] = self.uninformative.get(tid, True) and zero

    # ---------------------------------------------------------------- events
    def fold_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("ev")
        if "policy" in ev and ev["policy"] not in self.policy_index:
            self.stranger = self.stranger or ev  # refused by recovery once the shards are checked
            return
        if kind == "start":
            self.first_start = self.first_start or ev
            self.incarnation = ev["incarnation"]
        elif kind == "damaged":
            self.damaged[ev["shard"]] = f"found damaged while serving: {ev['why']}"
        elif kind == "samples":
            self.sample_hwm = max(self.sample_hwm, ev["hwm"])
        elif kind == "tasks":
            self.task_hwm = max(self.task_hwm, ev["hwm"])
        elif kind == "register":
            self.restarts[ev["base"]] = ev["k"]
        elif kind == "published":
            self.published.append(ev)
        elif kind == "ready":  # a restarted trainer: what it was served went back to the buffer
            i = self.policy_index[ev["policy"]]
            self.trainer_step[i] = ev["resume_step"]
            self.served[i].clear()
        elif kind == "served":
            i = self.policy_index[ev["policy"]]
            self.served[i][ev["step"]] = ids = np.asarray(ev["ids"], np.int64)
            self.served_count[i] += len(ids)
        elif kind == "consumed":
            i = self.policy_index[ev["policy"]]
            self.served[i].pop(ev["step"], None)
            self.consumed[i][ev["step"]] = np.asarray(ev["ids"], np.int64)
            self.trainer_step[i] = max(self.trainer_step[i], ev["step"])

    def fold_journal(self, path: Path, end: int | None = None) -> None:
        """The journal's lines from where this fold stopped up to byte `end` (its end), a
        line at a time; the last line is folded only if whole."""
        for line in journal_lines(path, self, end):
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line (fenced off by the next writer): its effect was never acknowledged
            self.fold_event(ev)

    # --------------------------------------------------------------- install
    def resolve(self) -> tuple[list[dict[int, np.ndarray]], list[dict[int, np.ndarray]], int]:
        """The ledgers' ids that are still stored, their states set in the table (CONSUMED,
        SERVED for served and not consumed), and how many consumed samples were lost with
        their shards: (consumed, served, lost) per policy."""
        consumed = [{} for _ in self.policy_names]
        served = [{} for _ in self.policy_names]
        lost = 0
        for i in range(len(self.policy_names)):
            for step, ids in self.consumed[i].items():
                consumed[i][step] = present = ids[self.samples.present(ids, i)]
                lost += len(ids) - len(present)
                self.samples.state[present] = CONSUMED
            for step, ids in self.served[i].items():
                served[i][step] = present = ids[self.samples.present(ids, i)]
                self.samples.state[present] = SERVED
        return consumed, served, lost

    # ------------------------------------------------------------ save, load
    def save(self, path: Path) -> None:
        """Write the fold to `path` atomically (a temporary file renamed over it), mode 0600."""
        header = {"format": FORMAT, "settings": self.settings, "rows_covered": self.rows_covered,
                  "next_sample_id": self.next_sample_id, "incarnation": self.incarnation,
                  "first_start": self.first_start, "damaged": self.damaged, "sample_hwm": self.sample_hwm,
                  "task_hwm": self.task_hwm, "restarts": self.restarts, "published": self.published,
                  "trainer_step": self.trainer_step, "journal_bytes": self.journal_bytes,
                  "journal_crc": self.journal_crc}
        arrays: dict[str, np.ndarray] = {f"samples.{c}": getattr(self.samples, c) for c in COLUMNS}
        arrays["done"], header["done_bits"] = self.done.packed()
        arrays["guided"] = self.guided
        arrays["served_count"] = self.served_count
        tids = np.fromiter(self.uninformative, np.int64, len(self.uninformative))
        arrays["uninformative.task"] = tids
        arrays["uninformative.zero"] = np.fromiter(self.uninformative.values(), bool, len(self.uninformative))
        for i in range(len(self.policy_names)):
            for ledger, steps in (("served", self.served[i]), ("consumed", self.consumed[i])):
                arrays.update(_ledger_arrays(f"{ledger}.{i}", steps))
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, cfg: Config) -> "Fold":
        """A saved fold; `ValueError` naming the file if it is not one this code wrote for
        these settings (a full replay is done instead)."""
        fold = cls(cfg)
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]))
                if header.get("format") != FORMAT:
                    raise ValueError(f"format {header.get('format')}, this code reads {FORMAT}")
                if header["settings"] != fold.settings:
                    raise ValueError(f"made for {header['settings']}, the config says {fold.settings}")
                fold.samples = SampleTable.of({c: z[f"samples.{c}"] for c in COLUMNS})
                fold.done = TaskSet.unpacked(z["done"], header["done_bits"])
                fold.guided = np.array(z["guided"])
                fold.served_count = np.array(z["served_count"])
                fold.uninformative = dict(zip(z["uninformative.task"].tolist(), z["uninformative.zero"].tolist()))
                for i in range(len(fold.policy_names)):
                    fold.served[i] = _ledger_from(z, f"served.{i}")
                    fold.consumed[i] = _ledger_from(z, f"consumed.{i}")
        except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile, zlib.error) as e:
            raise ValueError(f"{path}: not a usable compact state ({type(e).__name__}: {e})") from None
        for key in ("rows_covered", "next_sample_id", "incarnation", "first_start", "damaged", "sample_hwm",
                    "task_hwm", "restarts", "published", "trainer_step", "journal_bytes", "journal_crc"):
            setattr(fold, key, header[key])
        return fold

    def why_stale(self, journal: Path) -> str | None:
        """Why this (loaded) fold no longer describes the run's journal, or None: the prefix it
        read must be there unchanged. (Its shards are checked as recovery reads them:
        `DataflowState._fold_shards`.)"""
        size = journal.stat().st_size if journal.exists() else 0
        if size < self.journal_bytes:
            return f"the journal is shorter ({size} bytes) than the {self.journal_bytes} it folded"
        crc, left = 0, self.journal_bytes
        with open(journal, "rb") as f:
            while left > 0:
                block = f.read(min(left, 1 << 20))
                crc, left = zlib.crc32(block, crc), left - len(block)
        if crc != self.journal_crc:
            return "the journal's first bytes changed since (replaced or restored)"
        return None


def journal_lines(path: Path, fold: Fold, end: int | None = None) -> Iterator[bytes]:
    """Whole lines of the journal from `fold.journal_bytes` up to `end` (default: the file's
    size now), advancing the fold's byte count and CRC past each."""
    if not path.exists():
        return
    with open(path, "rb", buffering=1 << 20) as f:
        f.seek(fold.journal_bytes)
        remaining = (os.fstat(f.fileno()).st_size if end is None else end) - fold.journal_bytes
        while remaining > 0:
            line = f.readline(remaining)
            if not line.endswith(b"\n"):
                return  # a line being written (or torn): folded, if ever, by the next fold
            remaining -= len(line)
            fold.journal_bytes += len(line)
            fold.journal_crc = zlib.crc32(line, fold.journal_crc)
            if line.strip():
                yield line


def _ledger_arrays(prefix: str, steps: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """A ledger (step -> ids) as three arrays: the steps, the ids laid end to end, and each step's count."""
    order = list(steps)
    return {f"{prefix}.steps": np.array(order, np.int64),
            f"{prefix}.counts": np.array([len(steps[s]) for s in order], np.int64),
            f"{prefix}.ids": np.concatenate([steps[s] for s in order]) if order else np.zeros(0, np.int64)}


def _ledger_from(z: Any, prefix: str) -> dict[int, np.ndarray]:
    ids = np.array(z[f"{prefix}.ids"])
    bounds = np.cumsum(np.append(0, z[f"{prefix}.counts"]))
    return {step: ids[bounds[k]:bounds[k + 1]] for k, step in enumerate(z[f"{prefix}.steps"].tolist())}
