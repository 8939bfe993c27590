"""Writing a run's compact state (recovery.py) in a process of its own, beside the live rank.

`python -m astraflow.dataflow.compact RUN_DIR` reads, and never writes, the run's shards and
journal: it resumes the compact state there (if it still describes the journal), folds the
journal up to its end now, then every shard that is never written again and not yet
covered, and replaces the compact state (a temporary file renamed over it). The journal is
read before the shards, and the rank flushes a commit's rows before its journal line, so
every row the folded events name is stored by the time the shards are read.

The newest shard is never folded: the rank may be appending to it, and a group's advantage
needs all its rows (recovery reads it whole). A shard named damaged in the journal is not
folded either (its restart quarantines it). A shard it cannot read stops it, writing nothing:
the rank's recovery decides what damage is.

The dataflow rank starts it every `dataflow.compact_every_s` while the journal grows
(`Compaction`), at a lower priority, one at a time; a restart then reads the compact state
and only what came after it. It holds what the rank's recovery holds (the sample table:
38 bytes a stored sample) for the seconds it runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from astraflow.config.schema import Config
from astraflow.dataflow.recovery import COMPACT_STATE, RECOVERY_COLUMNS, Fold
from astraflow.store.errors import StoreRefused
from astraflow.store.reader import ShardCorrupt, ShardReader
from astraflow.store.writer import list_shards, shard_index

log = logging.getLogger(__name__)

NICENESS = 10  # the compaction yields the CPU to the rank, its workers and its trainers


def compact(run_dir: Path, cfg: Config) -> Fold:
    """Fold what the compact state of `run_dir` does not cover yet and save it; the new fold."""
    journal = run_dir / "journal" / "journal.jsonl"
    path = run_dir / "journal" / COMPACT_STATE
    fold = resumed(path, journal, cfg)
    fold.fold_journal(journal)
    if fold.stranger is not None:
        raise ValueError(f"{journal} names policy {fold.stranger['policy']!r}, not in the run's config")
    fold.samples.reserve(fold.sample_hwm, exact=True)
    for shard in list_shards(run_dir / "shards")[:-1]:  # the newest may be growing
        if shard.name in fold.damaged:
            continue
        reader = ShardReader(shard, locking=False, writer_alive=False)
        try:
            covered = fold.rows_covered.get(shard.name)
            if covered is not None:
                if reader.n_rows != covered:
                    raise ValueError(f"{shard} holds {reader.n_rows} good rows, {covered} when it was folded")
                continue
            fold.fold_shard(shard.name, shard_index(shard), reader.policy_names, reader.rows(RECOVERY_COLUMNS))
        finally:
            reader.close()
    fold.save(path)
    return fold


def resumed(path: Path, journal: Path, cfg: Config) -> Fold:
    """The saved fold to go on from, or an empty one if there is none that still fits."""
    if path.exists():
        try:
            fold = Fold.load(path, cfg)
            if fold.why_stale(journal) is None:
                return fold
        except ValueError as e:
            log.warning("%s: folding from the start", e)
    return Fold(cfg)


class Compaction:
    """Starts `python -m astraflow.dataflow.compact RUN_DIR` every `every_s` seconds while the
    journal grows (a run that stands still needs no new compact state), one at a time; the
    rank calls `poll` once a loop turn (a comparison, and `Popen.poll` while one runs)."""

    def __init__(self, run_dir: Path, every_s: float, clock=time.monotonic) -> None:
        self.run_dir = run_dir
        self.every_s = every_s
        self.clock = clock
        self.last_start = clock()
        self.journal_size = -1
        self.proc: subprocess.Popen | None = None
        self.done = self.failed = 0

    def poll(self) -> None:
        if self.proc is not None:
            code = self.proc.poll()
            if code is None:
                return
            self.proc = None
            if code == 0:
                self.done += 1
            else:
                self.failed += 1
                log.warning("compaction exited with %d (see above); recovery replays what it did not cover", code)
        if self.every_s <= 0 or self.clock() - self.last_start < self.every_s:
            return
        self.last_start = self.clock()
        size = (self.run_dir / "journal" / "journal.jsonl").stat().st_size
        if size == self.journal_size:
            return
        self.journal_size = size
        self.proc = subprocess.Popen([sys.executable, "-m", "astraflow.dataflow.compact", str(self.run_dir)],
                                     stdin=subprocess.DEVNULL)

    def close(self) -> None:
        """Stop a compaction in progress: it writes nothing until its last step, a rename."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        self.proc = None


def main(argv: list[str] | None = None) -> None:
    from astraflow.config.rundir import RunDir  # the run's config, checked as the rank checks it

    parser = argparse.ArgumentParser(prog="python -m astraflow.dataflow.compact", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s compaction %(levelname)s %(message)s")
    os.nice(NICENESS)
    started = time.monotonic()
    try:
        fold = compact(args.run_dir, RunDir.open(args.run_dir).config)
    except (ValueError, OSError, ShardCorrupt, StoreRefused) as e:
        log.error("no compact state written: %s", e)
        sys.exit(1)
    log.info("compact state written: %d shards, %d journal bytes, %d samples, in %.1fs", len(fold.rows_covered),
             fold.journal_bytes, fold.next_sample_id, time.monotonic() - started)


if __name__ == "__main__":
    main()
