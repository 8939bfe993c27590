"""A component that dies while starting is reported at once, with its own last error lines
from its log: the launcher does not wait out the rendezvous timeout (60 s) and then blame
the address; the preparation's failure and a component out of restarts quote their logs too."""
from __future__ import annotations

import sys
import time

import pytest

from astraflow.launch.supervisor import Component, ComponentFailed, Supervisor, last_error
from astraflow.protocol.client import wait_rendezvous

DIES = ("import sys; print('loading tasks'); sys.stdout.flush(); "
        "raise ValueError('data/tasks.jsonl:3: answer: expected a string')")


def test_a_rank_that_dies_at_start_is_reported_with_its_error_not_after_the_timeout(tmp_path):
    sup = Supervisor(max_restarts=3, backoff_s=0.1)
    name = sup.add(Component("dataflow", [[sys.executable, "-c", DIES]], tmp_path)).name
    t0 = time.monotonic()
    with pytest.raises(ComponentFailed) as e:
        wait_rendezvous(tmp_path, timeout_s=60, alive=lambda: sup.check_starting(name))
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "dataflow exited while starting" in msg and str(tmp_path / "dataflow.log") in msg
    assert "Traceback (most recent call last)" in msg
    assert msg.rstrip().endswith("ValueError: data/tasks.jsonl:3: answer: expected a string")


def test_a_component_out_of_restarts_quotes_the_last_start_of_its_log(tmp_path):
    sup = Supervisor(max_restarts=1, backoff_s=0.0)
    sup.add(Component("trainer-policy", [[sys.executable, "-c", DIES]], tmp_path))
    with pytest.raises(ComponentFailed) as e:
        for _ in range(200):
            sup.poll()
            time.sleep(0.05)
    msg = str(e.value)
    assert "failed 2 times" in msg and "Traceback" in msg
    assert msg.count("ValueError: data/tasks.jsonl:3") == 1  # the last start's, not both


def test_last_error_ends_at_the_last_error_line_and_ignores_earlier_starts(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("--- start x (restart 0)\nold ERROR gone\n--- start x (restart 1)\n"
                   + "".join(f"line {i}\n" for i in range(20)) + "RuntimeError: boom\nshutting down\n")
    out = last_error(log, lines=3).splitlines()
    assert [x.strip() for x in out] == ["line 18", "line 19", "RuntimeError: boom"]
    assert last_error(tmp_path / "missing.log") == ""
