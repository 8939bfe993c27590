"""Supervise a Slurm task's components until they are done or Slurm signals the task.

SIGUSR1 (Slurm's warning before the time limit or preemption), SIGTERM (scancel, requeue)
and SIGINT are forwarded to the components — trainers checkpoint, workers hand back their
leases — and the watch ends; the caller then stops what is left within `STOP_TIMEOUT_S`.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Callable

from astraflow.launch.supervisor import Supervisor

log = logging.getLogger(__name__)

POLL_S = 0.5
STOP_TIMEOUT_S = 30.0  # components checkpoint / hand back leases within Slurm's KillWait


class Watch:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def until(self, done: Callable[[list[str]], bool]) -> bool:
        """Poll (restarting crashed components) until `done(finished names)`; False on a signal."""
        while self.signal is None:
            if done(self.sup.poll()):
                return True
            time.sleep(POLL_S)
        log.info("signal %d: stopping the components", self.signal)
        return False

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signal = signum
        for comp in self.sup.components.values():
            for p in comp.procs:
                if p.poll() is None:
                    p.send_signal(signum)
