"""Start-up imports and builds with Python's cyclic garbage collector off, then frozen out of
its sight (`gc.freeze`).

Why: importing torch, transformers and vLLM, and building a vLLM engine, allocate ~0.7M
long-lived objects. While they arrive, the collector keeps running full collections over
everything allocated so far: 2-3 s of a vLLM rollout worker's start on 2 cores, under its GIL,
while the run waited for that worker; and every later full collection walks them again (a vLLM
engine's build calls `gc.collect()` five times: 1.2 s of its 2.1 s). Those objects live as long
as the process; the few cycles among them that become garbage are not worth those seconds.

Serving (`serving`): a rollout worker's event loop and engine allocate per-request objects that
live for a batch (~50 ms). At the default threshold (a young collection every 700 net
allocations) the collector ran ~100 times a second and walked the requests in flight each
time: 2.5 s of a quickstart worker's 75 s of serving, under the GIL that bounds its throughput.
At 20,000 it runs a few times in a whole run.

Invariant: on leaving `long_lived`, the collector is on exactly when it was on when entering,
and what was allocated inside is frozen (refcounting still frees it; only the cycle detector
skips it).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

SERVING_THRESHOLD = 20_000  # net allocations between young collections (Python's default: 700)


@contextmanager
def long_lived() -> Iterator[None]:
    """Allocate what the process keeps for its whole life (libraries, models, engines)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def serving() -> None:
    """Collect young objects rarely: for a process that serves many short requests."""
    gc.set_threshold(SERVING_THRESHOLD, *gc.get_threshold()[1:])
