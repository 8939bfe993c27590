"""A worker's keep-alive traffic (`rollout/keepalive.py`): nothing while it talks to the rank
and its episodes are short; renewals only for leases half their term old; a heartbeat after a
silent interval when there is nothing to renew; only requests that name the worker count as
contact (the rank marks nobody seen on a `Weights` poll or a `Status`)."""
from __future__ import annotations

from astraflow.protocol import messages as m
from astraflow.rollout.keepalive import is_contact, keepalive_due


def test_a_busy_worker_with_short_episodes_sends_nothing():
    assert keepalive_due(100.0, last_contact=99.0, leased_at={1: 75.0, 2: 99.5}, every=10.0, renew_after=30.0) \
        == (False, [])


def test_a_silent_worker_renews_only_leases_half_their_term_old_and_heartbeats_only_without_them():
    leased = {1: 65.0, 2: 95.0, 3: 70.0}
    assert keepalive_due(100.0, last_contact=90.0, leased_at=leased, every=10.0, renew_after=30.0) == (False, [1, 3])
    assert keepalive_due(100.0, last_contact=90.0, leased_at={2: 95.0}, every=10.0, renew_after=30.0) == (True, [])


def test_silence_stays_inside_the_ranks_timeout_when_checked_every_interval():
    """Checked at every multiple of `every`, the longest gap between answered requests is
    under 2 x every, against the rank's timeout of 3 x every (RegisterReply: timeout / 3)."""
    every, contact, longest = 10.0, 0.3, 0.0
    for tick in range(1, 50):
        now = tick * every
        if keepalive_due(now, contact, {}, every, renew_after=30.0)[0]:
            longest, contact = max(longest, now - contact), now
    assert 0 < longest < 2 * every


def test_only_requests_that_name_the_worker_are_contact():
    assert is_contact(m.Heartbeat("w.r0")) and is_contact(m.Renew("w.r0", [1]))
    assert not is_contact(m.Weights("policy")) and not is_contact(m.Status())
