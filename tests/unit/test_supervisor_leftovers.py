"""A component that dies leaves nothing behind: what it started (vLLM's engine-core process,
a sandbox) is killed with it, not adopted by init while the restarted component starts
another."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from astraflow.launch.supervisor import Component, Supervisor
from tests.unit.test_supervisor_parent_death import alive

# a component that starts a grandchild in its own process group, says its pid, and waits
PARENT = "sleep 300 & echo $! > {out}; wait"


def wait_until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def killed_parent(tmp_path: Path, sup: Supervisor) -> tuple[Component, int]:
    """A component killed alone (as the OOM killer would), and the pid of its still running
    grandchild."""
    out = tmp_path / "grandchild"
    comp = sup.add(Component("parent", [["sh", "-c", PARENT.format(out=out)]], tmp_path))
    assert wait_until(lambda: out.exists() and out.read_text().strip())
    grandchild = int(out.read_text())
    os.kill(comp.procs[0].pid, signal.SIGKILL)
    assert wait_until(lambda: comp.procs[0].poll() is not None)
    assert alive(grandchild)  # orphaned, still running
    return comp, grandchild


def test_a_killed_component_takes_what_it_started_with_it(tmp_path: Path):
    sup = Supervisor(max_restarts=1, backoff_s=30.0)
    _, grandchild = killed_parent(tmp_path, sup)
    sup.poll()  # notices the death (a restart is scheduled after the backoff)
    assert wait_until(lambda: not alive(grandchild)), "the orphan outlived its component"
    sup.stop()


def test_a_component_that_finishes_takes_what_it_left_running_with_it(tmp_path: Path):
    out = tmp_path / "grandchild"
    sup = Supervisor(max_restarts=0, backoff_s=1.0)
    sup.add(Component("quitter", [["sh", "-c", f"sleep 300 & echo $! > {out}; exit 0"]], tmp_path))
    assert wait_until(lambda: out.exists() and out.read_text().strip())
    grandchild = int(out.read_text())
    finished: list[str] = []
    assert wait_until(lambda: bool(finished.extend(sup.poll()) or finished)) and finished == ["quitter"]
    assert wait_until(lambda: not alive(grandchild)), "what it left running outlived it"


def test_stopping_a_component_that_died_unnoticed_takes_what_it_started_with_it(tmp_path: Path):
    sup = Supervisor(max_restarts=1, backoff_s=30.0)
    _, grandchild = killed_parent(tmp_path, sup)
    sup.stop()  # before any poll noticed the death
    assert wait_until(lambda: not alive(grandchild)), "the orphan outlived its stopped component"
