"""Noticing that a file the dataflow rank writes through an open descriptor was deleted or
replaced under it.

A process that writes to a deleted file writes into its inode: nothing fails, and all of
it is gone once the process closes the file. A journal deleted mid-run went unnoticed; the
rank acknowledged writes that landed nowhere, and the restarted rank began a new journal
(trainers' steps 1-60 missing from it, 128 samples trained twice). So after every write
that reaches the file, the writer compares the device and inode behind its path with its
descriptor's (one stat, only when something was written; nothing per idle loop turn) and
stops the rank, before the writes are acknowledged, when they differ or the path is gone.
What the descriptor still holds is copied to `<path>.rescued-<pid>` first: the only copy left.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from astraflow.store.errors import StoreStop


class FileVanished(StoreStop):
    """A file the rank was writing was deleted or replaced: the rank stops."""


class FileIdentity:
    def __init__(self, path: Path, fd: int, what: str) -> None:
        """`what` names the file in messages ("the journal", "the active shard")."""
        self.path, self.fd, self.what = Path(path), fd, what
        st = os.fstat(fd)
        self.key = (st.st_dev, st.st_ino)

    def check(self) -> None:
        """Raise `FileVanished` when the path no longer leads to the open file."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self.key:
                return
            how = "replaced by another file"
        except FileNotFoundError:
            how = "deleted"
        raise FileVanished(f"{self.path} ({self.what}) was {how} while the dataflow rank was writing it: what "
                           f"it wrote there would be lost, so it stops before acknowledging more; {self._rescue()}")

    def _rescue(self) -> str:
        """Copy what the descriptor holds next to the path (never over whatever is there now)."""
        rescued = self.path.with_name(f"{self.path.name}.rescued-{os.getpid()}")
        try:
            with open(f"/proc/self/fd/{self.fd}", "rb") as src, open(rescued, "xb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except OSError as e:
            return f"its content could not be rescued ({e})"
        return f"its content up to now was rescued to {rescued}: move it back to {self.path.name} to resume"
