"""Reading shards: the dataflow rank's recovery, `astraflow inspect` and post-hoc analysis.

Shards are always opened in SWMR-read mode: that reads a live shard (call `refresh()` to see
new rows), a closed one, and one whose writer was killed (a plain open refuses it). On
filesystems without POSIX write ordering (NFS) SWMR is not safe for a live shard; readers
there should use only closed shards (`closed_only=True` in `load_rows`).

A shard that cannot be read is reported as `ShardCorrupt`; the caller quarantines it. One that
is not damaged but must not be used as it is (a newer schema, no permission to read it) is
`StoreRefused` (store/errors.py): nothing is moved. A shard locked by another process, and an
error of the operating system that says nothing about the file's bytes (it vanished; too
many open files, I/O error, a stale handle: `TRANSIENT_ERRNOS`) are `ShardUnavailable`, a
refusal too: the dataflow rank tries locked and transient ones again (store/shards.py), and
only damage is ever quarantined. Rows
at the end of the table that point at nothing (a write cut short: rows of zeros, rows past
the data) are a torn tail: they are ignored and counted (`ShardReader.torn`, the
`torn` attribute of `load_rows`), and the rows before them are kept.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import h5py
import numpy as np

from astraflow.config.rundir import existing_run
from astraflow.store.errors import StoreRefused
from astraflow.store.schema import META_COLUMN, MISSING_DEFAULTS, READABLE_VERSIONS, ROW_COLUMNS, TOKEN_COLUMNS
from astraflow.store.swmr import LIVE_READ_ATTEMPTS, open_swmr
from astraflow.store.writer import list_shards


class ShardCorrupt(Exception):
    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


class ShardUnavailable(StoreRefused):
    """A shard that could not be opened or read for a reason outside the file: `kind` is
    "missing" (it vanished), "locked" (another process holds its lock: a rank still exiting,
    or another one running) or "transient" (an errno of `TRANSIENT_ERRNOS`)."""

    def __init__(self, path: Path, kind: str, code: int, what: str, tried: str = "") -> None:
        super().__init__(f"{path}: {what} ({os.strerror(code)}): {kind}, not damage; {tried}nothing was moved")
        self.path, self.kind, self.errno, self.what = path, kind, code, what


# Errors of the operating system or of a parallel filesystem's client that say nothing about
# the file's bytes: out of descriptors or memory, an interrupted or timed-out call, a server
# that went away (EIO and ESTALE on Lustre and NFS while a server fails over).
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOMEM,
                              errno.ETIMEDOUT, errno.ESTALE, errno.EBUSY, errno.ENOLCK, errno.ECONNRESET,
                              errno.ENOBUFS, errno.EHOSTDOWN})


def os_error(path: Path, e: BaseException, what: str) -> ShardUnavailable | None:
    """`e` as a `ShardUnavailable` if the operating system's error it carries is not damage.
    h5py passes the errno on as `e.errno` on an open, only in the message ("errno = 5") on a read."""
    code = getattr(e, "errno", None)
    if not isinstance(code, int):
        found = re.search(r"errno = (\d+)", str(e))
        code = int(found[1]) if found else None
    if code == errno.ENOENT:
        return ShardUnavailable(path, "missing", code, what)
    if code in TRANSIENT_ERRNOS:
        return ShardUnavailable(path, "transient", code, what)
    return None


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
LIVE_LOOKS, LIVE_LOOK_S = 3, 0.005  # further looks at a growing shard's rows before calling them torn
# Rows at most this far apart are read back in one span (the rows between are read too: at
# most this many records' data, against a read per dataset for each separate span).
SPAN_GAP_ROWS = 64


SWMR_WRITE_FLAGS = 0x05  # superblock v3 consistency flags of a file open for SWMR writing


def check_not_truncated(path: Path) -> bool:
    """Refuse a shard shorter than the end-of-file address its superblock records; returns
    whether the superblock marks it as open for SWMR writing (live, or its writer died).

    HDF5 checks the size itself on a normal open, but not in SWMR-read mode (the file may be
    growing), where reading a truncated file retries its metadata reads for minutes instead
    of failing. Superblock v2/v3 (what `libver="latest"` writes): signature(8), version(1),
    sizeof offsets(1), sizeof lengths(1), flags(1), then base, extension, end-of-file addresses.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(48)
            size = os.fstat(f.fileno()).st_size
    except PermissionError as e:
        raise StoreRefused(f"{path}: cannot be read ({e.strerror}): fix its permissions; nothing was moved") from None
    except OSError as e:
        raise os_error(path, e, "cannot open") or ShardCorrupt(path, f"cannot read: {e.strerror}") from None
    if head[:8] != HDF5_SIGNATURE:
        raise ShardCorrupt(path, "not an HDF5 file (bad signature)")
    if len(head) < 12 or head[8] not in (2, 3):
        return False
    width = head[9]
    at = 12 + 2 * width
    eoa = int.from_bytes(head[at:at + width], "little")
    if size < eoa:
        raise ShardCorrupt(path, f"truncated: {size} bytes on disk, the superblock records {eoa}")
    return head[11] & SWMR_WRITE_FLAGS == SWMR_WRITE_FLAGS


CHECK_FIELDS = ("offset", "length", "meta_offset", "meta_length", "policy")  # what `_good_prefix` reads
READ_ROWS = 1 << 20  # rows of the row table read at a time


class ShardReader:
    def __init__(self, path: Path, locking: bool = False, file: h5py.File | None = None,
                 writer_alive: bool = True) -> None:
        """`locking` must match any other open handle of the same file in this process (HDF5 rule).

        `writer_alive=False` (the dataflow rank's recovery: the only writer is not running) reads
        every shard as finished: a bad metadata checksum is damage at once (see swmr.py)."""
        self.path = Path(path)
        # a shard marked open for SWMR writing may be growing: a row that points at nothing
        # is looked at again before it is called torn (see `refresh`)
        self.writing = (check_not_truncated(self.path) and writer_alive) if file is None else True
        with self._damage("cannot open"):
            self.file = file if file is not None else self._open(locking)
        self.n_rows = 0
        self.torn = 0  # rows after the good ones that point at nothing (see `refresh`)
        self._ends = (0, 0)  # where the last good row's tokens and metadata end
        try:
            with self._damage("cannot open"):
                version = int(self.file.attrs["schema_version"])
                self.policy_names = tuple(p.decode() for p in self.file.attrs["policy_names"])
            if version not in READABLE_VERSIONS:
                raise StoreRefused(f"{self.path}: schema_version {version}, this code reads "
                                   f"{list(READABLE_VERSIONS)}: written by a newer AstraFlow, read it with that; "
                                   f"nothing was moved")
            if file is None:  # a reader over the writer's own open file needs no refresh
                self.refresh()
        except BaseException:
            if file is None:  # a reader that fails to start holds no file (a retried open would leak one each time)
                self.file.close()
            raise

    def _open(self, locking: bool) -> h5py.File:
        try:
            return open_swmr(self.path, LIVE_READ_ATTEMPTS if self.writing else 1, locking)
        except OSError as e:
            if "unable to lock file" in str(e):  # not damage: someone else holds it
                raise ShardUnavailable(self.path, "locked", e.errno or errno.EAGAIN,
                                       "locked by another process (is another dataflow rank running on this run "
                                       "directory?)") from None
            raise

    @contextlib.contextmanager
    def _damage(self, what: str) -> Iterator[None]:
        """Any failure to read this file is damage to it, reported as `ShardCorrupt`: h5py turns
        HDF5's errors into OSError, KeyError, ValueError, RuntimeError, TypeError, ... by call
        (a damaged object header made `attrs` raise RuntimeError, which crashed recovery)."""
        try:
            yield
        except (ShardCorrupt, StoreRefused):
            raise
        except Exception as e:  # noqa: BLE001 - see above
            raise os_error(self.path, e, what) or ShardCorrupt(self.path, f"{what} ({type(e).__name__}: {e})") from None

    def refresh(self) -> int:
        """Re-read dataset extents (live shards); returns the number of good rows.

        The row table is refreshed first, then the data: the writer appends data before rows,
        so data seen after a row always covers it. The other order saw rows appended after the
        data's extents were read, and called a healthy live shard corrupt in 4 of 10 refreshes.

        Rows are checked as they appear (`_good_prefix`); from the first one that points at
        nothing on, the rest of the table is a torn tail (`torn`): not read, not counted. In a
        shard that may be growing the rows and the data are read again (`LIVE_LOOKS` times)
        before a row is called torn, and a torn tail is looked at again at the next refresh:
        HDF5 may publish one dataset's new extent before another's (with data and rows in one
        flush, a live reader under load saw rows past the data in 2 of ~6,300 refreshes; the
        writer now flushes the data first)."""
        with self._damage("unreadable"):
            self.file["rows"].refresh()
            n = self.file["rows"].shape[0]
            if n < self.n_rows:
                raise ShardCorrupt(self.path, f"the row table shrank from {self.n_rows} rows to {n}")
            for look in range(1 + LIVE_LOOKS * self.writing):
                if look:
                    time.sleep(LIVE_LOOK_S)
                good, ends = self._good_prefix(n)
                if good == n - self.n_rows:
                    break
        self._ends = ends
        self.n_rows += good
        self.torn = n - self.n_rows
        return self.n_rows

    def _good_prefix(self, n: int) -> tuple[int, tuple[int, int]]:
        """Refresh the data's extents; how many of the rows from `n_rows` to `n` are good, and
        where the last good one's tokens and metadata end. Read `READ_ROWS` at a time, the
        fields checked only: the whole table of a 5 M-row shard is ~1 GB.

        A good row has at least one token, starts where the previous row's tokens and metadata
        end (the writer lays them out back to back), lies inside the data and names a policy of
        the shard. A write cut short (ENOSPC inside HDF5) left rows of zeros: sample 0, no
        tokens, offset 0."""
        for name in (*TOKEN_COLUMNS, META_COLUMN):
            self.file[name].refresh()
        tokens = min(self.file[c].shape[0] for c in TOKEN_COLUMNS)
        meta = self.file[META_COLUMN].shape[0]
        checked = self.file["rows"].fields(list(CHECK_FIELDS))
        good, ends = 0, self._ends
        for lo in range(self.n_rows, n, READ_ROWS):
            new = checked[lo:min(n, lo + READ_ROWS)]
            length, meta_length = new["length"].astype(np.int64), new["meta_length"].astype(np.int64)
            start = ends[0] + np.concatenate([[0], np.cumsum(length)[:-1]])
            meta_start = ends[1] + np.concatenate([[0], np.cumsum(meta_length)[:-1]])
            ok = ((length >= 1) & (meta_length >= 0) & (new["offset"] == start) & (new["meta_offset"] == meta_start)
                  & (start + length <= tokens) & (meta_start + meta_length <= meta)
                  & (new["policy"] < len(self.policy_names)))
            count = len(new) if ok.all() else int(np.argmin(ok))
            if count:
                ends = (int(start[count - 1] + length[count - 1]), int(meta_start[count - 1] + meta_length[count - 1]))
            good += count
            if count < len(new):
                break
        return good, ends

    def rows(self, columns: tuple[str, ...] = tuple(ROW_COLUMNS), start: int = 0) -> dict[str, np.ndarray]:
        """The row table's `columns` (one an older schema lacks reads as its default) of the
        good rows from `start` on, read `READ_ROWS` rows at a time into one array per column:
        only those columns are ever held (recovery reads 7 of 18), never the whole table."""
        n = max(0, self.n_rows - start)
        with self._damage("row table unreadable"):
            dataset = self.file["rows"]
            stored = [c for c in columns if c in dataset.dtype.names]
            out = {c: np.empty(n, dataset.dtype[c]) for c in stored}
            if stored:
                selected = dataset.fields(stored)
                for lo in range(0, n, READ_ROWS):
                    block = selected[start + lo:start + min(n, lo + READ_ROWS)]
                    for c in stored:
                        out[c][lo:lo + len(block)] = block[c]
            return {c: out[c] if c in out else np.full(n, MISSING_DEFAULTS.get(c, 0), ROW_COLUMNS[c])
                    for c in columns}

    def verify(self) -> None:
        """Walk the chunk index of every data dataset (metadata only, no data is read), so that
        damage there is found now, at recovery, and not when a sample is served."""
        with self._damage("chunk index unreadable"):
            for name in (*TOKEN_COLUMNS, META_COLUMN):
                self.file[name].id.chunk_iter(lambda chunk: None)

    def trajectory(self, row: int) -> dict[str, Any]:
        """One stored row with its per-token arrays and decoded metadata."""
        return self.records([row])[0]

    def records(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Stored rows with their per-token arrays and decoded metadata, in the order asked.

        Rows close together (`SPAN_GAP_ROWS`) are read as one span: one read of the row table
        and one of each data dataset per span, whatever its length. One read per row and
        dataset cost milliseconds a row, and a batch of 256 read back took a second."""
        wanted = np.unique(np.asarray(rows, np.int64))
        out: dict[int, dict[str, Any]] = {}
        with self._damage(f"{_row_range(wanted)} unreadable"):
            for lo, hi in _spans(wanted, SPAN_GAP_ROWS):
                table = self.file["rows"][lo:hi]
                if len(table) != hi - lo:
                    raise ShardCorrupt(self.path, f"row {hi - 1} asked for, the row table has {lo + len(table)}")
                t0 = int(table["offset"][0])
                t1 = int(table["offset"][-1]) + int(table["length"][-1])
                m0 = int(table["meta_offset"][0])
                m1 = int(table["meta_offset"][-1]) + int(table["meta_length"][-1])
                data = {c: self.file[c][t0:t1] for c in TOKEN_COLUMNS}
                meta = self.file[META_COLUMN][m0:m1]
                for row in wanted[(wanted >= lo) & (wanted < hi)]:
                    out[int(row)] = self._record(table[row - lo], data, t0, meta, m0)
        return [out[int(r)] for r in rows]

    def _record(self, rec: np.void, data: dict[str, np.ndarray], t0: int, meta: np.ndarray, m0: int
                ) -> dict[str, Any]:
        """One row of the table with its slices of a span's data (read from `t0`, `m0`)."""
        r = {c: _column(rec, c) for c in ROW_COLUMNS}
        lo, n = int(r["offset"]) - t0, int(r["length"])
        out: dict[str, Any] = {c: a[lo:lo + n] for c, a in data.items()}
        if len(out["tokens"]) != n:
            raise ShardCorrupt(self.path, f"sample {int(r['sample_id'])}: its tokens lie outside the data")
        mlo, mn = int(r["meta_offset"]) - m0, int(r["meta_length"])
        out["meta"] = json.loads(meta[mlo:mlo + mn].tobytes() or b"{}")
        out.update({k: v.item() if hasattr(v, "item") else v for k, v in r.items()})
        out["worker"] = r["worker"].decode(errors="replace")
        out["policy"] = self.policy_names[int(r["policy"])]
        return out

    def data(self, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The named token datasets (and `meta_bytes`), as far as the good rows reach: one read
        each, for slicing many rows (`iter_trajectories`) instead of one read per row."""
        with self._damage("data unreadable"):
            return {c: self.file[c][: self._ends[1] if c == META_COLUMN else self._ends[0]] for c in columns}

    def close(self) -> None:
        self.file.close()


def _column(table: np.ndarray | np.void, name: str) -> np.ndarray:
    """A column of the row table; one an older schema lacks reads as zeros."""
    if name in table.dtype.names:
        return table[name]
    return np.full(table.shape, MISSING_DEFAULTS.get(name, 0), ROW_COLUMNS[name])


def _spans(rows: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering the sorted, distinct `rows`, split where two are more than `gap` apart."""
    if not len(rows):
        return []
    cuts = np.flatnonzero(np.diff(rows) > gap) + 1
    return [(int(part[0]), int(part[-1]) + 1) for part in np.split(rows, cuts)]


def _row_range(rows: np.ndarray) -> str:
    """How an error names the rows being read: "row 7", "rows 3..9"."""
    return f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]}..{rows[-1]}" if len(rows) else "no rows"


def iter_shards(run_dir: Path) -> Iterator[Path]:
    yield from list_shards(Path(run_dir) / "shards")


def _selected_shards(run_dir: str | Path, closed_only: bool) -> list[Path]:
    shards = list(iter_shards(existing_run(run_dir, "shards")))
    if closed_only and shards and _open_for_writing(shards[-1]):
        shards = shards[:-1]
    return shards


def iter_trajectories(run_dir: str | Path, columns: tuple[str, ...] = tuple(TOKEN_COLUMNS),
                      closed_only: bool = False) -> Iterator[dict[str, Any]]:
    """Every stored trajectory, shard by shard: its row (as in `load_rows`, `policy` a name),
    its per-token `columns` and its decoded `meta`. Each shard's data is read at once, so a
    trajectory costs microseconds (`load_trajectory` reads one row: milliseconds). Unreadable
    shards are skipped, as in `load_rows`."""
    for path in _selected_shards(run_dir, closed_only):
        try:
            reader = ShardReader(path)
        except (ShardCorrupt, StoreRefused):
            continue
        try:
            rows = reader.rows()
            data = reader.data((*columns, META_COLUMN))
        except ShardCorrupt:
            continue
        finally:
            reader.close()
        meta = data.pop(META_COLUMN)
        for i in range(len(rows["sample_id"])):
            lo, n = int(rows["offset"][i]), int(rows["length"][i])
            mlo, mn = int(rows["meta_offset"][i]), int(rows["meta_length"][i])
            record = {k: v[i].item() for k, v in rows.items()}
            record.update(policy=reader.policy_names[record["policy"]], shard=path.name, row=i,
                          worker=rows["worker"][i].decode(errors="replace"),
                          meta=json.loads(meta[mlo:mlo + mn].tobytes() or b"{}"))
            record.update({c: a[lo:lo + n] for c, a in data.items()})
            yield record


def load_rows(run_dir: str | Path, closed_only: bool = False, verify: bool = False) -> "Any":
    """All stored trajectories of a run as a pandas DataFrame (one row per trajectory).

    Columns: the row table plus `policy` as a name, `shard`, `row`. `closed_only` leaves out the
    newest shard while it is open for writing (for NFS, where reading a live shard is not safe);
    a finished run's shards are all closed and all read. Skips unreadable shards
    (they are listed in `df.attrs["skipped"]`) and torn tails (`df.attrs["torn"]`: shard name
    -> rows ignored). With `verify`, a shard whose data cannot be found (its chunk index is
    damaged, `ShardReader.verify`) is skipped too. A path with no `shards/` folder is no run:
    `NoRunDir` (a FileNotFoundError), never an empty frame.
    """
    import pandas as pd

    frames, skipped, torn = [], [], {}
    for path in _selected_shards(run_dir, closed_only):
        try:
            reader = ShardReader(path)
        except (ShardCorrupt, StoreRefused) as e:
            skipped.append(str(e))
            continue
        try:
            cols = reader.rows()
            if verify:
                reader.verify()
        except ShardCorrupt as e:
            skipped.append(str(e))
            continue
        finally:
            reader.close()
        if reader.torn:
            torn[path.name] = reader.torn
        df = pd.DataFrame({k: v for k, v in cols.items()})
        df["policy"] = [reader.policy_names[i] for i in cols["policy"]]
        df["worker"] = df["worker"].str.decode("utf-8", errors="replace")  # damaged bytes are no reason to fail
        df["shard"] = path.name
        df["row"] = np.arange(len(df))
        frames.append(df)
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(ROW_COLUMNS))
    out.attrs["skipped"] = skipped
    out.attrs["torn"] = torn
    return out


def _open_for_writing(path: Path) -> bool:
    """Whether a shard may still grow: the newest shard whose superblock is marked open for SWMR
    writing (its writer is live, or was killed). Every older shard is never written again, and
    the last one of a finished run was closed, which clears the mark."""
    try:
        return check_not_truncated(path)
    except (ShardCorrupt, StoreRefused):
        return False  # not read as live: reading it reports the damage as for any shard


def load_trajectory(run_dir: str | Path, shard: str, row: int) -> dict[str, Any]:
    reader = ShardReader(Path(run_dir) / "shards" / shard)
    try:
        return reader.trajectory(row)
    finally:
        reader.close()
