"""The shard directory as the dataflow rank sees it: recover, append, flush, read back.

`recover()` opens every existing shard read-only and yields its row table; a shard that
cannot be read is moved to `shards/quarantine/` and reported, so its tasks count as never
committed and are handed out again. A readable shard that does not match the run (its
policies) is refused, `StoreRefused`, before anything is moved. Rows of a torn tail (reader.py) are left out, logged
and counted in `torn_rows`: their commits were never acknowledged, their tasks are handed
out again. A new active shard is then started (the old ones are
never written again). Locations are `(shard_index, row)` pairs.

Open shards are bounded (parallel-filesystem manners): at most `max_open_shards` readers are
kept, least recently used closed first, so a run of thousands of shards needs no more file
descriptors than that, at recovery and while serving. An error on opening or reading a shard
is classified (reader.py): damage (`ShardCorrupt`) is quarantined; a shard unreadable to
this user is refused (`StoreRefused`) and one that vanished is `ShardUnavailable` "missing":
nothing is moved; a lock held by another process and a transient error of the operating
system (too many open files, EIO, ESTALE, ...) are tried again `OPEN_ATTEMPTS` times with
doubling waits, after giving back descriptors when they ran out, and if they persist the
rank stops (`ShardUnavailable`), moving nothing, and its restart tries again. So only a shard
proven damaged is ever quarantined.
"""
from __future__ import annotations

import errno
import logging
import shutil
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

from astraflow.store.errors import StoreRefused
from astraflow.store.reader import ShardCorrupt, ShardReader, ShardUnavailable
from astraflow.store.schema import ROW_COLUMNS
from astraflow.store.writer import RowBatch, ShardWriter, StoreOptions, list_shards, shard_index, shard_name

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRIED = ("transient", "locked")  # kinds of `ShardUnavailable` tried again (a lock: its holder may be exiting)
OPEN_ATTEMPTS = 6  # tried again after 0.05, 0.1, 0.2, 0.4 and 0.8 s
FIRST_RETRY_S = 0.05


class ShardStore:
    def __init__(self, shard_dir: Path, policy_names: tuple[str, ...], opts: StoreOptions) -> None:
        self.dir = Path(shard_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.policy_names = policy_names
        self.opts = opts
        self.quarantined: list[str] = []
        self.torn_rows: dict[str, int] = {}  # shard name -> rows of a torn tail, ignored
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()  # the least recently used first
        self.retries = 0  # transient errors tried again (status: store.retries)
        self._writer: ShardWriter | None = None
        self._writer_index = -1
        self._writer_reader: ShardReader | None = None

    # ------------------------------------------------------------- recovery
    def recover(self, damaged: dict[str, str] | None = None, columns: tuple[str, ...] = tuple(ROW_COLUMNS),
                skip: dict[str, int] | None = None) -> Iterator[tuple[int, ShardReader, dict[str, np.ndarray]]]:
        """Open every shard now; the iterator returned then yields (index, reader, the row
        table's `columns` of the good rows past the first `skip[name]`) of every good shard
        and quarantines the damaged ones and those named in `damaged` (name -> why: found
        unreadable while serving).

        Every shard is opened before anything is moved: a shard that is readable but must not
        be used as it is — stored for other policies than the config names (a policy renamed
        in the config), a newer schema, unreadable to this user — raises `StoreRefused` and
        leaves every file where it is. Quarantine is for damaged files only: a renamed policy
        once quarantined every shard, and restoring the config did not bring them back."""
        opened: list[tuple[Path, bool, str]] = []  # (shard, readable, why it is damaged)
        for path in list_shards(self.dir):
            if damaged and path.name in damaged:
                opened.append((path, False, damaged[path.name]))
                continue
            try:
                reader = self._with_reader(shard_index(path), lambda r: r)
            except ShardCorrupt as e:
                opened.append((path, False, e.why))
                continue
            opened.append((path, True, ""))
            if reader.policy_names != self.policy_names[: len(reader.policy_names)]:
                raise StoreRefused(
                    f"{path} stores policies {list(reader.policy_names)} but the run's config names "
                    f"{list(self.policy_names)}: the config no longer matches the stored data (policies "
                    f"may be added at the end, not renamed, removed or reordered); restore the config's "
                    f"policies. Nothing was moved")
        return self._recovered(opened, columns, skip or {})

    def _recovered(self, opened: list[tuple[Path, bool, str]], columns: tuple[str, ...], skip: dict[str, int]
                   ) -> Iterator[tuple[int, ShardReader, dict[str, np.ndarray]]]:
        for path, readable, why in opened:
            idx = shard_index(path)
            try:
                if not readable:
                    raise ShardCorrupt(path, why)
                reader, rows = self._with_reader(idx, lambda r: (r, r.rows(columns, skip.get(path.name, 0))))
                self._with_reader(idx, ShardReader.verify)
            except ShardCorrupt as e:
                self._drop(idx)
                self._quarantine(path, e.why)
                continue
            if reader.torn:
                self.torn_rows[path.name] = reader.torn
                log.warning("shard %s: its last %d rows point at nothing (a write cut short, never acknowledged): "
                            "ignored; the %d rows before them are kept", path.name, reader.torn, reader.n_rows)
            yield idx, reader, rows
            del rows  # not held while the next shard is read

    def _quarantine(self, path: Path, why: str) -> None:
        qdir = self.dir / "quarantine"
        qdir.mkdir(exist_ok=True)
        shutil.move(str(path), qdir / path.name)
        self.quarantined.append(f"{path.name}: {why}")
        log.error("quarantined shard %s: %s", path.name, why)

    # ---------------------------------------------------------------- write
    def _active(self) -> ShardWriter:
        if self._writer is None:
            existing = [shard_index(p) for p in list_shards(self.dir)]
            existing += [shard_index(p) for p in (self.dir / "quarantine").glob("shard-*.h5")]
            self._writer_index = max(existing, default=-1) + 1
            self._writer = ShardWriter(self.dir / shard_name(self._writer_index), self.policy_names, self.opts)
        return self._writer

    def append(self, batch: RowBatch) -> list[tuple[int, int]]:
        writer = self._active()
        return [(self._writer_index, r) for r in writer.stage(batch)]

    def flush(self) -> None:
        """Write everything staged; afterwards it survives a SIGKILL. Rotates at the size limit."""
        if self._writer is None:
            return
        self._writer.flush()
        if self._writer.bytes_written >= self.opts.shard_max_bytes:
            self._writer.close()
            self._writer = None

    def written(self, locs: list[tuple[int, int]]) -> bool:
        """Whether every location is in its file already, not only staged for the next flush."""
        if self._writer is None:
            return True
        return all(idx != self._writer_index or row < self._writer.n_rows for idx, row in locs)

    def staged_bytes(self) -> int:
        """An upper bound of what the next `flush()` writes."""
        return self._writer.staged_bytes() if self._writer is not None else 0

    @property
    def active_shard(self) -> str | None:
        return self._writer.path.name if self._writer else None

    # ----------------------------------------------------------------- read
    def read(self, locs: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """The records at `locs`, in order: one batched read per shard (`ShardReader.records`)."""
        by_shard: dict[int, list[int]] = {}
        for idx, row in locs:
            by_shard.setdefault(idx, []).append(row)
        found = {}
        for idx, rows in by_shard.items():
            records = self._with_reader(idx, lambda r: r.records(rows))
            found.update(((idx, row), rec) for row, rec in zip(rows, records))
        return [found[loc] for loc in locs]

    @property
    def open_shards(self) -> int:
        """Shards held open for reading (at most `max_open_shards`; the active one's own reader aside)."""
        return len(self._readers)

    def _with_reader(self, idx: int, action: Callable[[ShardReader], T]) -> T:
        """`action` on shard `idx`'s reader, opening it if need be; a transient error is tried
        again (on a fresh handle: the old one may be what went stale) with doubling waits."""
        wait, waited = FIRST_RETRY_S, 0.0
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            try:
                return action(self._reader(idx))
            except ShardUnavailable as e:
                self._drop(idx)
                if e.kind not in RETRIED:
                    raise
                if attempt == OPEN_ATTEMPTS:
                    raise ShardUnavailable(e.path, e.kind, e.errno, e.what,
                                           f"tried {attempt} times in {waited:.2f}s, the rank stops and its "
                                           f"restart tries again; ") from None
                self.retries += 1
                if e.errno in (errno.EMFILE, errno.ENFILE):  # give descriptors back before trying again
                    self._evict(max(1, len(self._readers) // 2))
                log.warning("%s; trying again in %.2fs", e, wait)
                time.sleep(wait)
                waited, wait = waited + wait, wait * 2
        raise AssertionError("unreachable")

    def _reader(self, idx: int) -> ShardReader:
        if self._writer is not None and idx == self._writer_index:
            if self._writer_reader is None or self._writer_reader.file is not self._writer.file:
                self._writer_reader = ShardReader(self._writer.path, file=self._writer.file)
            return self._writer_reader
        reader = self._readers.get(idx)
        if reader is not None:
            self._readers.move_to_end(idx)
            return reader
        # no writer is at any shard but the active one: a bad checksum is damage at once (swmr.py)
        reader = ShardReader(self.dir / shard_name(idx), locking=self.opts.locking, writer_alive=False)
        self._readers[idx] = reader
        self._evict(len(self._readers) - self.opts.max_open_shards)
        return reader

    def _evict(self, n: int) -> None:
        """Close the `n` least recently used readers."""
        for _ in range(min(n, len(self._readers))):
            self._readers.popitem(last=False)[1].close()

    def _drop(self, idx: int) -> None:
        reader = self._readers.pop(idx, None)
        if reader is not None:
            reader.close()

    def close(self, drop_staged: bool = False) -> None:
        if self._writer is not None:
            self._writer.close(drop_staged)
            self._writer = None
        for r in self._readers.values():
            r.close()
        self._readers.clear()
