"""The single writer of HDF5 trajectory shards.

`append()` stages a batch of trajectories in memory and returns where each will live;
`flush()` writes every staged batch into the active shard and flushes it (and fsyncs when
configured). Only after `flush()` returns may the caller acknowledge those trajectories: a
SIGKILL at any later instant keeps them (SWMR keeps the file readable up to the last flush).
The active shard is rotated at a size limit, only at flush boundaries. A shard that was
being written when its writer died is never reopened for writing: the next writer starts a
new shard (`shard-NNNNNN.h5`, numbered after the highest existing one).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from astraflow.store.identity import FileIdentity
from astraflow.store.schema import (COLUMN_DOCS, INPUT_ROW_COLUMNS, META_COLUMN, ROW_COLUMNS, ROW_DTYPE,
                                    SCHEMA_VERSION, TOKEN_COLUMNS, VERSION_NONE)

ROW_CHUNK = 4096
# What a flush may add to a shard beyond its data and chunks: chunk-index blocks, object
# header updates, free-space bookkeeping (a few KiB measured; generous on purpose)
METADATA_ROOM = 1 << 20


@dataclass
class RowBatch:
    """Trajectories to append: concatenated per-token arrays, one entry per row elsewhere."""
    tokens: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]
    meta: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows["sample_id"])


@dataclass(frozen=True)
class StoreOptions:
    compression: str = "none"  # none | lzf | gzip
    gzip_level: int = 4
    shard_max_bytes: int = 512 << 20
    chunk_tokens: int = 1 << 16
    locking: bool = True
    fsync: bool = False
    max_open_shards: int = 64  # readers kept open (least recently used closed first)


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.h5"


def shard_index(path: Path) -> int:
    return int(path.stem.split("-")[1])


def list_shards(shard_dir: Path) -> list[Path]:
    return sorted(shard_dir.glob("shard-*.h5"), key=shard_index)


def check_batch(batch: RowBatch, n_policies: int) -> None:
    """Refuse a batch that would not read back: readers take a row of no tokens, or of a
    policy the shard does not name, for the start of a torn tail (see reader.py)."""
    n = len(batch.rows.get("sample_id", ()))
    missing = [c for c in INPUT_ROW_COLUMNS if c not in batch.rows] + [c for c in TOKEN_COLUMNS if c not in batch.tokens]
    if missing:
        raise ValueError(f"row batch lacks columns {missing}")
    uneven = [c for c in INPUT_ROW_COLUMNS if len(batch.rows[c]) != n]
    if uneven or len(batch.meta) != n:
        raise ValueError(f"row batch columns {uneven or ['meta']} do not have {n} entries")
    n_tok = len(batch.tokens["tokens"])
    if any(len(batch.tokens[c]) != n_tok for c in TOKEN_COLUMNS) or int(batch.rows["length"].sum()) != n_tok:
        raise ValueError("row batch token arrays and lengths disagree")
    if n and (int(batch.rows["length"].min()) < 1 or int(batch.rows["policy"].max()) >= n_policies):
        raise ValueError(f"row batch has a trajectory of no tokens or a policy index outside [0, {n_policies})")


def describe(file: h5py.File) -> None:
    """Write the columns' meanings and units as attributes (`COLUMN_DOCS`); before SWMR mode,
    which forbids adding attributes."""
    file.attrs["description"] = ("AstraFlow trajectory shard: one row of the compound dataset `rows` per stored "
                                 "trajectory, indexing the flat per-token datasets; each dataset's attributes "
                                 "describe its columns")
    file.attrs["version_none"] = VERSION_NONE
    for name in (*TOKEN_COLUMNS, META_COLUMN):
        file[name].attrs["description"] = COLUMN_DOCS[name]
    for name in ROW_COLUMNS:
        file["rows"].attrs[name] = COLUMN_DOCS[name]


class ShardWriter:
    def __init__(self, path: Path, policy_names: tuple[str, ...], opts: StoreOptions) -> None:
        self.path = path
        self.opts = opts
        self.file = h5py.File(path, "w", libver="latest", locking=opts.locking)
        self.file.attrs["schema_version"] = SCHEMA_VERSION
        self.file.attrs["policy_names"] = np.array(policy_names, dtype="S64")
        self.n_policies = len(policy_names)
        self.file.attrs["created"] = time.time()
        comp = {"none": {}, "lzf": {"compression": "lzf"},
                "gzip": {"compression": "gzip", "compression_opts": opts.gzip_level}}[opts.compression]
        self.ds: dict[str, h5py.Dataset] = {}
        for name, dtype in TOKEN_COLUMNS.items():
            self.ds[name] = self.file.create_dataset(
                name, (0,), maxshape=(None,), dtype=dtype, chunks=(opts.chunk_tokens,), **comp)
        self.ds[META_COLUMN] = self.file.create_dataset(
            META_COLUMN, (0,), maxshape=(None,), dtype="u1", chunks=(1 << 14,), **comp)
        self.ds["rows"] = self.file.create_dataset(
            "rows", (0,), maxshape=(None,), dtype=ROW_DTYPE, chunks=(ROW_CHUNK,), **comp)
        describe(self.file)
        self.file.swmr_mode = True
        self._identity = FileIdentity(path, self.file.id.get_vfd_handle(), "the active shard")
        self._chunk_bytes = sum(ds.chunks[0] * ds.dtype.itemsize for ds in self.ds.values())
        self.n_rows = 0
        self.n_tokens = 0
        self.n_meta = 0
        self.bytes_written = 0
        self._staged: list[RowBatch] = []

    def stage(self, batch: RowBatch) -> list[int]:
        """Queue a batch; returns the row indices it will occupy once flushed.

        A malformed batch is refused here, so that `flush()` cannot fail on it later.
        """
        check_batch(batch, self.n_policies)
        first = self.n_rows + sum(len(b) for b in self._staged)
        self._staged.append(batch)
        return list(range(first, first + len(batch)))

    @property
    def pending(self) -> int:
        return len(self._staged)

    def staged_bytes(self) -> int:
        """An upper bound of what `flush()` adds to the file: the staged data and rows, a fresh
        chunk of every dataset (HDF5 allocates chunks whole) and room for its own metadata."""
        if not self._staged:
            return 0
        data = sum(a.nbytes for b in self._staged for a in b.tokens.values())
        data += sum(len(m) for b in self._staged for m in b.meta) + ROW_DTYPE.itemsize * sum(map(len, self._staged))
        return data + self._chunk_bytes + METADATA_ROOM

    def flush(self) -> None:
        if not self._staged:
            return
        batches, self._staged = self._staged, []
        tokens = {k: np.concatenate([b.tokens[k] for b in batches]) for k in TOKEN_COLUMNS}
        rows = {k: np.concatenate([b.rows[k] for b in batches]) for k in INPUT_ROW_COLUMNS}
        meta = [m for b in batches for m in b.meta]
        lengths = rows["length"].astype(np.int64)
        rows["offset"] = self.n_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        meta_len = np.fromiter((len(m) for m in meta), dtype=np.int64, count=len(meta))
        rows["meta_offset"] = self.n_meta + np.concatenate([[0], np.cumsum(meta_len)[:-1]])
        rows["meta_length"] = meta_len.astype(np.int32)
        n_tok = int(lengths.sum())
        # Token and meta data first, flushed; the row table after, flushed again: a row is only
        # visible to readers (and to recovery) once the data it points to is in the file. One
        # flush for both let HDF5 publish the rows' extent before the data's, which a live
        # reader saw under load (2 of ~6,000 refreshes); the second flush costs no measurable time.
        for name, arr in tokens.items():
            self._extend(name, self.n_tokens, arr)
        self._extend(META_COLUMN, self.n_meta, np.frombuffer(b"".join(meta), dtype="u1"))
        self.file.flush()
        n = sum(len(b) for b in batches)
        table = np.empty(n, ROW_DTYPE)
        for name in ROW_COLUMNS:
            table[name] = rows[name]
        self._extend("rows", self.n_rows, table)
        self.file.flush()
        if self.opts.fsync:
            os.fsync(self.file.id.get_vfd_handle())
        self._identity.check()  # deleted or replaced: stop before acknowledging (identity.py)
        self.n_rows += n
        self.n_tokens += n_tok
        self.n_meta += int(meta_len.sum())
        self.bytes_written += sum(a.nbytes for a in tokens.values()) + int(meta_len.sum())

    def _extend(self, name: str, start: int, arr: np.ndarray) -> None:
        if len(arr) == 0:
            return
        ds = self.ds[name]
        ds.resize((start + len(arr),))
        ds[start:start + len(arr)] = arr

    def close(self, drop_staged: bool = False) -> None:
        """Flush what is staged and close; or, with `drop_staged`, close without writing it."""
        if drop_staged:
            self._staged.clear()
        self.flush()
        self.file.close()
