"""A trainer group whose ranks live under different supervisors restarts as a whole:
real child processes, two supervisors sharing a `GroupGeneration` directory."""
from __future__ import annotations

import time
from pathlib import Path

from astraflow.launch.supervisor import Component, GroupGeneration, Supervisor


def test_generation_advances_once_per_failure(tmp_path: Path):
    a, b = GroupGeneration(tmp_path, "torch-p-s"), GroupGeneration(tmp_path, "torch-p-s")
    assert a.current() == 0
    assert a.advance(0) == 1 and b.advance(0) == 1  # both saw generation 0 fail: one move
    assert b.advance(1) == 2


def test_a_failed_rank_restarts_its_peer_under_the_next_generation(tmp_path: Path):
    gen_dir = tmp_path / "rendezvous"
    gen_dir.mkdir()
    starts = tmp_path / "starts"
    starts.touch()
    # rank 0 fails once (at generation 0); rank 1 is healthy and keeps running
    fails_once = f'echo "r0 $ASTRAFLOW_START" >> {starts}; [ "$ASTRAFLOW_START" = 0 ] && exit 3; sleep 30'
    healthy = f'echo "r1 $ASTRAFLOW_START" >> {starts}; sleep 30'
    sups = [Supervisor(max_restarts=3, backoff_s=0.05) for _ in range(2)]
    for sup, (name, cmd) in zip(sups, (("r0", fails_once), ("r1", healthy))):
        sup.add(Component(name, [["sh", "-c", cmd]], tmp_path, generation=GroupGeneration(gen_dir, "torch-p-s")))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "r1 1" not in starts.read_text().splitlines():
            for sup in sups:
                sup.poll()
            time.sleep(0.05)
        lines = starts.read_text().splitlines()
        assert "r0 1" in lines and lines.count("r1 1") == 1  # the healthy rank was restarted too
        assert all(c.restarts == 1 for sup in sups for c in sup.components.values())
    finally:
        for sup in sups:
            sup.stop(timeout_s=2)
