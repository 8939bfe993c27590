"""The sandbox's process confinements that are not namespaces or rlimits (Linux prctl).

- `drop_bounding_set`: empties the capability bounding set, so that nothing the process or
  its children exec can ever gain a capability back (file capabilities, setuid root). Needs
  CAP_SETPCAP: done while still root, before the switch to the sandbox uid (which then clears
  the effective and permitted sets as usual).
- `no_new_privs`: PR_SET_NO_NEW_PRIVS, inherited and irreversible: execve never grants more
  privileges (setuid bits and file capabilities are ignored); also what lets an unprivileged
  process load a seccomp filter.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}): {os.strerror(err)}")


def drop_bounding_set() -> None:
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)


def no_new_privs() -> None:
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
