"""The elastic controller's decision rule and its back-off from arrays that never start."""
from __future__ import annotations

from astraflow.config.schema import ElasticConfig
from astraflow.slurm.elastic import decide, failed_in_a_row

CFG = ElasticConfig(enabled=True, min_workers=1, max_workers=3, step=2, grow_above=0.5, shrink_below=0.1,
                    cooldown_s=60)


def test_thresholds_bounds_and_cooldown():
    assert decide(0.9, 1, CFG, 100, 60) == ("grow", 2)
    assert decide(0.9, 2, CFG, 100, 60) == ("grow", 1)  # capped by max_workers
    assert decide(0.9, 3, CFG, 100, 60) == ("hold:bounds", 0)
    assert decide(0.3, 2, CFG, 100, 60) == ("hold:band", 0)  # between the thresholds
    assert decide(0.0, 3, CFG, 100, 60) == ("shrink", 2)
    assert decide(0.0, 2, CFG, 100, 60) == ("shrink", 1)  # floored by min_workers
    assert decide(0.0, 1, CFG, 100, 60) == ("hold:bounds", 0)
    assert decide(0.9, 0, CFG, 100, 60) == ("grow", 1)  # below min: back to the floor first
    assert decide(0.0, 5, CFG, 100, 60) == ("shrink", 2)  # above max: back to the ceiling
    assert decide(0.9, 1, CFG, 59, 60) == ("hold:cooldown", 0)  # whatever the load


def test_arrays_that_never_started_count_in_a_row():
    arrays = [{"job_id": str(i), "reason": "elastic: wait", "cancelled": []} for i in (10, 11, 12)]
    assert failed_in_a_row(arrays, present=set(), registered=set()) == 3
    assert failed_in_a_row(arrays, present=set(), registered={"11_0"}) == 1  # 12 failed after 11 worked
    assert failed_in_a_row(arrays, present={"12_0"}, registered=set()) == 0  # still queued: not failed yet
    arrays[-1]["cancelled"] = [0]  # removed by the controller itself: not a failure
    assert failed_in_a_row(arrays, present=set(), registered=set()) == 0
    user = [*arrays[:2], {"job_id": "13", "reason": "scale --add", "cancelled": []}]
    assert failed_in_a_row(user, present=set(), registered=set()) == 2  # the user's arrays are not the controller's
