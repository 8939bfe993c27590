"""Invitations to standby rollout workers: the one-file contract between a launcher and them.

A standby directory (0700) holds at most one announcement, `run.json` = `{"run_dir", "id"}`,
replaced atomically (write, then rename), so a reader sees a whole announcement or none.
The id is unique per announcement, so a run announced again (resumed) is joined again.
Torch-free: the launcher imports it.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from astraflow.config.loader import ConfigError

log = logging.getLogger(__name__)

ANNOUNCEMENT = "run.json"


def announce(standby: Path, run_path: Path) -> str:
    """Invite the standby workers in `standby` to join this run; returns the announcement id."""
    private_dir(standby)
    ident = f"{run_path.resolve()}@{time.time_ns()}"
    tmp = standby / f".{ANNOUNCEMENT}.{os.getpid()}"
    tmp.write_text(json.dumps({"run_dir": str(run_path.resolve()), "id": ident}))
    os.replace(tmp, standby / ANNOUNCEMENT)
    return ident


def withdraw(standby: Path, ident: str) -> None:
    """End the invitation `ident` (a later run's announcement is left alone)."""
    current = announced(standby)
    if current is not None and current.get("id") == ident:
        (standby / ANNOUNCEMENT).unlink(missing_ok=True)


def announced(standby: Path) -> dict | None:
    try:
        note = json.loads((standby / ANNOUNCEMENT).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable announcement (%s); ignoring it", standby / ANNOUNCEMENT, e)
        return None
    if not isinstance(note, dict) or not isinstance(note.get("run_dir"), str) or not isinstance(note.get("id"), str):
        log.warning("%s: expected {\"run_dir\": str, \"id\": str}, got %r; ignoring it", standby / ANNOUNCEMENT, note)
        return None
    return note


def private_dir(standby: Path) -> Path:
    """The standby directory, created 0700 if missing, refused if others may write it."""
    standby.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(standby)
    return standby


def check_private(standby: Path) -> None:
    """Whoever can write the standby directory decides which run its workers join."""
    mode = standby.stat().st_mode & 0o777
    if mode & 0o022:
        raise ConfigError(f"{standby}: standby directory is writable by others (mode {mode:04o}); "
                          f"run `chmod 700 {standby}`")
