"""Trainer checkpoint bookkeeping: `checkpoints/<policy>/step-<N>[.pt]` entries (a file or a
directory, whatever the backend writes, always atomically: temporary name, fsync, rename);
the newest `KEEP` are kept. The weight versions of kept checkpoints are pinned: the dataflow
rank's retention never deletes them."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

KEEP = 2
_ENTRY = re.compile(r"step-(\d+)(\.pt)?$")


def _entries(ckpt_dir: Path) -> dict[int, Path]:
    if not Path(ckpt_dir).is_dir():
        return {}
    return {int(m.group(1)): p for p in Path(ckpt_dir).iterdir() if (m := _ENTRY.match(p.name))}


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    return sorted(_entries(ckpt_dir))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    entries = _entries(ckpt_dir)
    return entries[max(entries)] if entries else None


def prune_checkpoints(ckpt_dir: Path) -> None:
    entries = _entries(ckpt_dir)
    for step in sorted(entries)[:-KEEP]:
        path = entries[step]
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def commit_file(tmp: Path, final: Path) -> Path:
    """fsync `tmp`, rename it to `final` and fsync the directory: atomic and durable."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
