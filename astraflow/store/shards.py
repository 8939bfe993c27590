"""The shard directory as the dataflow rank sees it: recover, append, flush, read back.

`recover()` opens every existing shard read-only and yields its row table; a shard that
cannot be read is moved to `shards/quarantine/` and reported, so its tasks count as never
committed and are handed out again. Rows of a torn tail (reader.py) are left out, logged
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
        """Yield (index, reader, row table) of every good shard; quarantine the rest, and the
        shards named in `damaged` (name -> why: found unreadable while serving)."""
        for path in list_shards(self.dir):
            idx = shard_index(path)
            if damaged and path.name in damaged:
                self._quarantine(path, damaged[path.name])
                continue
            reader = None
            try:
                reader = ShardReader(path, locking=self.opts.locking, writer_alive=False)
                rows = reader.rows()
                reader.verify()
            except ShardCorrupt as e:
                if reader is not None:
                    reader.close()
                self._quarantine(path, e.why)
                continue
            if reader.policy_names != self.policy_names[: len(reader.policy_names)]:
                reader.close()
                self._quarantine(path, f"policy list {reader.policy_names} does not match the run's")
                continue
            if reader.torn:
                self.torn_rows[path.name] = reader.torn
                log.warning("shard %s: its last %d rows point at nothing (a write cut short, never acknowledged): "
                            "ignored; the %d rows before them are kept", path.name, reader.torn, reader.n_rows)
            self._readers[idx] = reader
            yield idx, reader, rows

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
