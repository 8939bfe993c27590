"""The dataflow rank's journal: the few facts that the shards do not hold.

One JSON object per line in `RUN_DIR/journal/journal.jsonl`, appended and flushed before the
reply that depends on it is sent: which samples each trainer step consumed, trainer
(re)starts, published weight versions, the task high-water mark, worker registrations.
Together with the shards this is enough to rebuild the dataflow rank's state. A process
killed mid-write leaves at most one torn last line, which replay ignores (its reply was
never sent); a write cut short (a full disk) is taken back and stops the rank
(appendonly.py). A journal deleted or replaced under the rank stops it (identity.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from astraflow.store.appendonly import write_whole
from astraflow.store.identity import FileIdentity


class Journal:
    def __init__(self, journal_dir: Path, fsync: bool = False) -> None:
        journal_dir.mkdir(parents=True, exist_ok=True)
        self.path = journal_dir / "journal.jsonl"
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._identity = FileIdentity(self.path, self._fd, "the run's journal")
        self._pending: list[str] = []
        if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            os.write(self._fd, b"\n")  # fence off a torn line left by a killed writer

    def append(self, event: str, **fields: Any) -> None:
        self._pending.append(json.dumps({"ev": event, **fields}, separators=(",", ":")))

    def flush(self) -> None:
        if not self._pending:
            return
        data = ("\n".join(self._pending) + "\n").encode()
        self._pending.clear()
        write_whole(self._fd, data, self.path)  # a short write (disk full) stops the rank, nothing torn
        if self.fsync:
            os.fsync(self._fd)
        self._identity.check()  # deleted or replaced: stop before acknowledging (identity.py)

    def pending_bytes(self) -> int:
        return sum(len(line) + 1 for line in self._pending)  # json.dumps writes ASCII

    def close(self, drop_pending: bool = False) -> None:
        """Flush what is pending and close; or, with `drop_pending`, close without writing it."""
        if self._fd < 0:
            return  # closed already
        if drop_pending:
            self._pending.clear()
        self.flush()
        os.close(self._fd)
        self._fd = -1


def replay(journal_dir: Path) -> Iterator[dict[str, Any]]:
    path = journal_dir / "journal.jsonl"
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line: its effect was never acknowledged
