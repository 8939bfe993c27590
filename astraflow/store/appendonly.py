"""Appending to the run's line files (the journal, the clients' ledgers, the elastic log) whole or not at all.

One `write` on an O_APPEND descriptor, so a killed process cannot tear a line, and a short
write (a full filesystem, a file-size limit) is cut back off before the error is raised: the
next line never lands behind half of this one, and a reader never has to guess. Each file has
one writer, which is what makes cutting back to the size before the write safe.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_whole(fd: int, data: bytes, path: Path) -> None:
    """Append `data` entirely to `fd` (opened O_APPEND, at `path`); raises OSError with the
    file as it was if it could not."""
    size = os.fstat(fd).st_size
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(f"{path}: only {written} of {len(data)} bytes written (filesystem full?)")
    except OSError:
        os.ftruncate(fd, size)
        raise


def append_json_line(path: Path, record: dict[str, Any]) -> None:
    """`record` as one JSON line at the end of the file at `path`, whole or not at all."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        write_whole(fd, (json.dumps(record) + "\n").encode(), path)
    finally:
        os.close(fd)
