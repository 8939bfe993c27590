"""Opening a shard in SWMR-read mode with a bounded number of metadata read attempts.

In SWMR-read mode HDF5 takes a metadata checksum that does not match for a write in
progress and reads again, sleeping 1 ns, 2 ns, 4 ns, ... between attempts, 100 times by
default: on a damaged file that is 2^99 ns, a reader that never returns (measured: a shard
with 16 bytes overwritten in an object header hung every reader). The number of attempts
is a file-access property that h5py does not expose, so it is set here through the very
libhdf5 h5py loaded (found in this process's memory map). One attempt suffices where no
writer can be at work; a live shard gets `LIVE_READ_ATTEMPTS` (about half a second of
retries in all, far more than one metadata write takes).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import h5py

log = logging.getLogger(__name__)

LIVE_READ_ATTEMPTS = 30  # sleeps of 1 ns doubling: ~0.5 s before a bad checksum is an error


@functools.cache
def _set_read_attempts():
    """`H5Pset_metadata_read_attempts` of the libhdf5 h5py uses, or None where it cannot be found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libhdf5" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        if Path(path).name.startswith("libhdf5_hl"):
            continue
        fn = ctypes.CDLL(path).H5Pset_metadata_read_attempts  # the loaded library: dlopen shares it
        fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int
        return fn
    log.warning("libhdf5 not found in the memory map: a damaged shard may make readers wait for a long time")
    return None


def open_swmr(path: Path, attempts: int, locking: bool) -> h5py.File:
    """`h5py.File(path, "r", swmr=True, locking=locking)`, giving up on a bad checksum after `attempts` reads."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_file_locking(locking, False)
    setter = _set_read_attempts()
    if setter is not None and setter(fapl.id, attempts) < 0:
        raise OSError(f"H5Pset_metadata_read_attempts({attempts}) failed")
    fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl)
    return h5py.File(fid)
