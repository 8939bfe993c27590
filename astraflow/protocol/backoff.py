"""How long a client waits before asking again after the dataflow rank said "not now".

A refused lease (backpressure, every task handed out, no policy this worker serves) used to
be asked again every 0.2 s (the rank's hint), by every worker: with a thousand workers that
is thousands of requests a second carrying no work, each a turn of the rank's one thread.
Refusals in a row now double the wait, up to `cap_s`, each wait drawn from its upper half
(jitter: workers refused together do not come back together), never shorter than the rank's
hint; a reply that carries work resets it.
"""
from __future__ import annotations

import random


class Backoff:
    def __init__(self, first_s: float = 0.2, cap_s: float = 2.0, rng: random.Random | None = None) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self.rng = rng or random.Random()
        self.refusals = 0  # in a row

    def delay(self, hint_s: float = 0.0) -> float:
        """The wait after one more refusal; at least `hint_s` (the rank's `retry_after_s`)."""
        ceiling = min(self.cap_s, self.first_s * 2.0 ** min(self.refusals, 32))
        self.refusals += 1
        return max(hint_s, ceiling * self.rng.uniform(0.5, 1.0))

    def reset(self) -> None:
        self.refusals = 0
