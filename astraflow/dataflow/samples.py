"""What the dataflow rank keeps about every stored sample, one numpy column per field.

Rows are indexed by sample id: ids are handed out in order (`DataflowState._row_batch`), so
the table is dense but for the ids of shards lost since and the block an incarnation skips
(`SAMPLE_HWM_BLOCK`). A row is 38 bytes: 10 M stored samples hold ~380 MB. One Python object
per sample, as before, held ~900 bytes (a rank with 1 M stored samples peaked at 944 MB).

Invariants:
- `policy` is ABSENT (-1) for an id with no stored sample (never handed out, or in a shard
  lost since); every other column of such a row is meaningless;
- a sample belongs to one policy for good; only `state` changes after it is stored (the
  buffers own it: buffers.py);
- the table only grows, by half its size at a time and in place, so a column (or a view of
  one) kept across a `put` may point at freed memory: read the columns through the table
  within one statement, never keep them.
"""
from __future__ import annotations

import numpy as np

ABSENT = -1
COLUMNS: dict[str, np.dtype] = {
    "policy": np.dtype(np.int8),  # index into the run's policies; ABSENT: no sample
    "state": np.dtype(np.int8),  # buffers.READY, FILTERED, SERVED, CONSUMED or DROPPED
    "task_id": np.dtype(np.int64),
    "version_min": np.dtype(np.int32),  # the oldest weight version any of its own tokens came from
    "advantage": np.dtype(np.float32),
    "group_mean": np.dtype(np.float32),
    "group_std": np.dtype(np.float32),
    "shard": np.dtype(np.int32),  # where it is stored: shard index and row
    "row": np.dtype(np.int32),
    "tokens": np.dtype(np.int32),  # its length (the memory its cached payload holds)
}


class SampleTable:
    def __init__(self) -> None:
        self.capacity = 0
        for name, dtype in COLUMNS.items():
            setattr(self, name, np.empty(0, dtype))

    @classmethod
    def of(cls, columns: dict[str, np.ndarray]) -> "SampleTable":
        """A table holding `columns` (every one of `COLUMNS`, of one length: its capacity),
        taken as they are where they own their memory (they grow in place: `reserve`)."""
        table = cls()
        for name, dtype in COLUMNS.items():
            column = np.asarray(columns[name], dtype)
            setattr(table, name, column if column.flags.owndata and column.flags.writeable else column.copy())
        table.capacity = len(table.policy)
        return table

    def reserve(self, n_ids: int, exact: bool = False) -> None:
        """Room for ids below `n_ids`: exactly (recovery knows how many), else by half again.
        Columns grow in place (realloc, which moves large blocks by remapping pages): a copy
        would hold the old and the new table at once, 950 MB at 10 M samples."""
        if n_ids <= self.capacity:
            return
        new = n_ids if exact else max(n_ids, self.capacity + self.capacity // 2, 1024)
        for name in COLUMNS:
            getattr(self, name).resize(new, refcheck=False)  # no views of a column outlive a statement
        self.policy[self.capacity:] = ABSENT
        self.capacity = new

    def put(self, ids: np.ndarray, **columns: np.ndarray | float | int) -> None:
        """Store rows `ids` (all of `COLUMNS` given, arrays of len(ids) or scalars)."""
        if len(ids):
            self.reserve(int(ids.max()) + 1)
        for name in COLUMNS:
            getattr(self, name)[ids] = columns[name]

    def ids_of(self, policy: int) -> np.ndarray:
        """The ids of the policy's stored samples, ascending."""
        return np.flatnonzero(self.policy == policy)

    def present(self, ids: np.ndarray, policy: int) -> np.ndarray:
        """Of `ids`, which are stored samples of `policy` (a mask)."""
        ids = np.asarray(ids, np.int64)
        inside = (ids >= 0) & (ids < self.capacity)
        mask = np.zeros(len(ids), bool)
        mask[inside] = self.policy[ids[inside]] == policy
        return mask
