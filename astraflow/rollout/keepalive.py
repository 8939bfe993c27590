"""What a rollout worker sends to stay alive at the dataflow rank, and nothing more.

Every answered request that names the worker tells the rank that it lives (the rank marks
a worker seen on each of its requests; `Weights` and `Status` name nobody: `is_contact`), so
a `Heartbeat` is due only after `every` seconds without such a request when no renewal goes out (a `Renew` says the worker lives, too), and a
lease is renewed only once it is half its term old (`renew_after`: an episode shorter than
that never renews). Checked every `every` seconds (at most a third of the lease term), a
worker is silent at most 2 × `every`, inside the rank's timeout of 3 × `every`, and a lease
is renewed before 5/6 of its term. Timers that fire regardless would make most of a
thousand workers' messages carry no work (`astraflow bench scale` counts them).
"""
from __future__ import annotations


def keepalive_due(now: float, last_contact: float, leased_at: dict[int, float], every: float,
                  renew_after: float) -> tuple[bool, list[int]]:
    """(whether a Heartbeat is due, the leased tasks whose lease is due for renewal)."""
    renew = [t for t, at in leased_at.items() if now - at >= renew_after]
    return not renew and now - last_contact >= every, renew


def is_contact(request: object) -> bool:
    """Whether the rank, answering `request`, marked its worker seen: it names the worker."""
    return bool(getattr(request, "worker_id", ""))
