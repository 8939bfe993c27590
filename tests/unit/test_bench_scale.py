"""`astraflow bench scale` on a small run: simulated workers over the real protocol against a
real dataflow rank that is SIGKILLed and restarted at the end. With a keep-alive interval of
1 s, leases of 6 s and generations of 3 s on average, leases get renewed, none expires and no
worker is declared dead (silence stays inside the rank's timeout); every acknowledged commit
is recovered once."""
from __future__ import annotations

from astraflow.bench.scale import run_bench


def test_bench_scale_keeps_every_worker_alive_and_recovers_every_acknowledged_commit():
    r = run_bench(clients=48, stored=10_000, seconds=8.0, processes=2, tokens=16, gen_s=3.0,
                  heartbeat_timeout_s=3.0, lease_s=6.0)
    assert r["problems"] == [], r
    assert r["committed_trajectories"] > 0 and r["recovered_stored"] == 10_000 + r["committed_trajectories"]
    assert r["messages"]["renew"] > 0, r["messages"]
    assert not {"workers_dead", "leases_expired"} & set(r["dataflow_requests"]), r["dataflow_requests"]
    assert r["consumer_steps"] > 0 and r["served_trajectories"] == 256 * r["consumer_steps"]
    assert r["latency"]["commit"]["n"] == r["messages"]["commit"]
    assert 0 < r["restart_after_kill_s"] < 60 and r["no_work_fraction"] < 0.5
