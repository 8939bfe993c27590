"""`astraflow.heap`: start-up allocations leave the collector's sight, and its state is restored."""
from __future__ import annotations

import gc

from astraflow.heap import SERVING_THRESHOLD, long_lived, serving


def test_long_lived_freezes_what_it_allocates_and_restores_the_collector() -> None:
    before = gc.get_freeze_count()
    try:
        with long_lived():
            assert not gc.isenabled()
            kept = [{"n": i} for i in range(5000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(kept)
        gc.disable()
        with long_lived():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()
        gc.unfreeze()


def test_serving_raises_only_the_young_threshold() -> None:
    saved = gc.get_threshold()
    try:
        serving()
        assert gc.get_threshold() == (SERVING_THRESHOLD, *saved[1:])
    finally:
        gc.set_threshold(*saved)
