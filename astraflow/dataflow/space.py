"""Free space on the run directory's filesystem for the rank's flush guard, without a statfs
on every turn of its loop.

`statfs` (`shutil.disk_usage`) on Lustre or GPFS asks every storage target, and the rank
flushes up to hundreds of times a second. So while the filesystem has plenty of room
(`HEADROOM` beyond what the guard keeps) it is measured at most every `INTERVAL_S`, and
between measurements estimated as the last measurement less what this rank has flushed
since (an upper bound of it). Closer to full than that, it is measured before every flush,
as it always was: the guard then decides on a measurement, never on an estimate. What
other writers can fill within one interval is what `HEADROOM` must cover.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

INTERVAL_S = 1.0
HEADROOM = 4 << 30  # bytes: beyond this much room, an estimate up to INTERVAL_S old is trusted


class FreeSpace:
    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path = path
        self.clock = clock
        self.measured_at = float("-inf")
        self.estimate = 0
        self.measurements = 0  # statfs calls made (status: store.free_space_checks)

    def free(self, keep: int) -> int:
        """Free bytes now, for a flush that must leave `keep` bytes free: measured unless the
        last measurement is recent and the estimate leaves `HEADROOM` beyond `keep`."""
        now = self.clock()
        if now - self.measured_at >= INTERVAL_S or self.estimate < keep + HEADROOM:
            self.estimate = shutil.disk_usage(self.path).free
            self.measured_at = now
            self.measurements += 1
        return self.estimate

    def wrote(self, nbytes: int) -> None:
        """A flush of at most `nbytes` went to the filesystem."""
        self.estimate -= nbytes
