"""The shard directory as the dataflow rank sees it: recover, append, flush, read back.

`recover()` opens every existing shard read-only and yields its row table; a shard that
cannot be read is moved to `shards/quarantine/` and reported, so its tasks count as never
committed and are handed out again. A readable shard that does not match the run (its
policies) is refused, `StoreRefused`, before anything is moved. Rows of a torn tail (reader.py) are left out, logged
and counted in `torn_rows`: their commits were never acknowledged, their tasks are handed
out again. A new active shard is then started (the old ones are
never written again). Locations are `(shard_index, row)` pairs.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from astraflow.store.errors import StoreRefused
from astraflow.store.reader import ShardCorrupt, ShardReader
from astraflow.store.writer import RowBatch, ShardWriter, StoreOptions, list_shards, shard_index, shard_name

log = logging.getLogger(__name__)


class ShardStore:
    def __init__(self, shard_dir: Path, policy_names: tuple[str, ...], opts: StoreOptions) -> None:
        self.dir = Path(shard_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.policy_names = policy_names
        self.opts = opts
        self.quarantined: list[str] = []
        self.torn_rows: dict[str, int] = {}  # shard name -> rows of a torn tail, ignored
        self._readers: dict[int, ShardReader] = {}
        self._writer: ShardWriter | None = None
        self._writer_index = -1
        self._writer_reader: ShardReader | None = None

    # ------------------------------------------------------------- recovery
    def recover(self, damaged: dict[str, str] | None = None
                ) -> Iterator[tuple[int, ShardReader, dict[str, np.ndarray]]]:
        """Open every shard now; the iterator returned then yields (index, reader, row table) of
        every good shard and quarantines the damaged ones and those named in `damaged` (name ->
        why: found unreadable while serving).

        Every shard is opened before anything is moved: a shard that is readable but must not
        be used as it is — stored for other policies than the config names (a policy renamed
        in the config), a newer schema, unreadable to this user — raises `StoreRefused` and
        leaves every file where it is. Quarantine is for damaged files only: a renamed policy
        once quarantined every shard, and restoring the config did not bring them back."""
        opened: list[tuple[Path, ShardReader | None, str]] = []  # (shard, reader, why it is damaged)
        for path in list_shards(self.dir):
            if damaged and path.name in damaged:
                opened.append((path, None, damaged[path.name]))
                continue
            try:
                reader = ShardReader(path, locking=self.opts.locking, writer_alive=False)
            except ShardCorrupt as e:
                opened.append((path, None, e.why))
                continue
            self._readers[shard_index(path)] = reader  # closed by close(), whatever happens next
            opened.append((path, reader, ""))
            if reader.policy_names != self.policy_names[: len(reader.policy_names)]:
                raise StoreRefused(
                    f"{path} stores policies {list(reader.policy_names)} but the run's config names "
                    f"{list(self.policy_names)}: the config no longer matches the stored data (policies "
                    f"may be added at the end, not renamed, removed or reordered); restore the config's "
                    f"policies. Nothing was moved")
        return self._recovered(opened)

    def _recovered(self, opened: list[tuple[Path, ShardReader | None, str]]
                   ) -> Iterator[tuple[int, ShardReader, dict[str, np.ndarray]]]:
        for path, reader, why in opened:
            try:
                if reader is None:
                    raise ShardCorrupt(path, why)
                rows = reader.rows()
                reader.verify()
            except ShardCorrupt as e:
                if reader is not None:
                    self._readers.pop(shard_index(path)).close()
                self._quarantine(path, e.why)
                continue
            if reader.torn:
                self.torn_rows[path.name] = reader.torn
                log.warning("shard %s: its last %d rows point at nothing (a write cut short, never acknowledged): "
                            "ignored; the %d rows before them are kept", path.name, reader.torn, reader.n_rows)
            yield shard_index(path), reader, rows

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

    def staged_bytes(self) -> int:
        """An upper bound of what the next `flush()` writes."""
        return self._writer.staged_bytes() if self._writer is not None else 0

    @property
    def active_shard(self) -> str | None:
        return self._writer.path.name if self._writer else None

    # ----------------------------------------------------------------- read
    def read(self, loc: tuple[int, int]) -> dict[str, Any]:
        idx, row = loc
        if self._writer is not None and idx == self._writer_index:
            if self._writer_reader is None or self._writer_reader.file is not self._writer.file:
                self._writer_reader = ShardReader(self._writer.path, file=self._writer.file)
            return self._writer_reader.trajectory(row)
        reader = self._readers.get(idx)
        if reader is None:
            reader = self._readers[idx] = ShardReader(self.dir / shard_name(idx), locking=self.opts.locking)
        return reader.trajectory(row)

    def close(self, drop_staged: bool = False) -> None:
        if self._writer is not None:
            self._writer.close(drop_staged)
            self._writer = None
        for r in self._readers.values():
            r.close()
        self._readers.clear()
