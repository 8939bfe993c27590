"""A refused lease is asked again later and later (protocol/backoff.py): doubling waits with
jitter, capped, never shorter than the rank's hint, back to the first wait once work comes.

Before: every worker asked again every 0.2 s for as long as it was refused — 300 requests a
minute each, thousands a second from a thousand workers, none carrying work."""
from __future__ import annotations

import random

from astraflow.protocol.backoff import Backoff

HINT_S = 0.2  # the rank's retry_after_s for backpressure and a drained queue


def requests_while_refused(backoff: Backoff, seconds: float) -> int:
    waited, asked = 0.0, 0
    while waited < seconds:
        asked += 1
        waited += backoff.delay(HINT_S)
    return asked


def test_a_worker_refused_for_a_minute_asks_about_forty_times_not_three_hundred():
    asked = requests_while_refused(Backoff(rng=random.Random(0)), 60.0)
    assert asked <= 70, asked  # at most 2 s apart once capped, at least 1 s: 30..60 and the ramp
    assert asked >= 30, asked


def test_waits_double_stay_within_the_cap_and_the_hint_and_are_jittered():
    backoff = Backoff(first_s=0.2, cap_s=2.0, rng=random.Random(1))
    waits = [backoff.delay(0.0) for _ in range(12)]
    for i, w in enumerate(waits):
        ceiling = min(2.0, 0.2 * 2 ** i)
        assert ceiling / 2 <= w <= ceiling
    assert len({round(w, 6) for w in waits[5:]}) == len(waits[5:])  # capped waits still differ
    assert Backoff(rng=random.Random(2)).delay(5.0) == 5.0  # the rank's hint is a floor


def test_work_resets_the_wait():
    backoff = Backoff(rng=random.Random(3))
    for _ in range(10):
        backoff.delay()
    backoff.reset()
    assert backoff.delay() <= 0.2
