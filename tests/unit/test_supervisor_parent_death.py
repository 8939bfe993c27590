"""A supervisor killed with SIGKILL takes its components with it (no orphaned ranks)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO

SUPERVISOR = """
import sys, time
from pathlib import Path
from astraflow.launch.supervisor import Component, Supervisor
sup = Supervisor(max_restarts=0, backoff_s=1.0)
comp = sup.add(Component("sleeper", [[sys.executable, "-c", "import time; time.sleep(120)"]], Path(sys.argv[1])))
print(comp.procs[0].pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_components_die_with_their_supervisor(tmp_path):
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                           cwd=REPO)
    child = int(sup.stdout.readline())
    assert alive(child)
    sup.send_signal(signal.SIGKILL)
    sup.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)
