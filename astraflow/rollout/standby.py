"""Standby rollout workers: engine processes that outlive a run and serve the next one.

A standby directory holds at most one announcement (`rollout/invitation.py`), written by
the launcher of a run whose config sets `rollout.standby` once that run's dataflow rank is
up, and removed by the same launcher when the run ends — before its rank stops, so the
workers hand their leases back to a rank still listening.

`astraflow rollout --standby DIR` waits for an announcement, joins that run as an ordinary
worker (`RolloutWorker`), and leaves it when the announcement is withdrawn or replaced, or
when the run has no tasks left; then it waits for the next announcement. Its engines are
built for the first run it joins. For a later run with the same engine and model settings
and the same hosted policies, every engine loads that run's starting weights in place as
version 0 (the in-place reload every new weight version goes through); otherwise the engines
are rebuilt. So successive runs — a benchmark's modes, a sweep — share warm engine
processes and pay start-up once. The engines' random streams continue from run to run.

Invariants: a standby worker belongs to at most one run at a time and never joins the same
announcement twice; it joins only runs whose directory (and secret) its user can read; a
failed membership (a bad run directory, a workflow error) is logged and the worker waits
for the next run instead of exiting.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path
from typing import Any

from astraflow.config.loader import ConfigError
from astraflow.config.rundir import RunDir
from astraflow.models import policy_model_dir
from astraflow.rollout.invitation import ANNOUNCEMENT, announced, private_dir
from astraflow.rollout.worker import RolloutWorker, build_engines, run_until_stopped

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the announcement is read


class StandbyWorker:
    def __init__(self, standby: Path, policies: list[str], base_id: str) -> None:
        self.standby, self.policies, self.base_id = standby, policies, base_id
        self.stopping = False
        self.current: RolloutWorker | None = None
        self.engines: dict[str, Any] | None = None
        self.engine_key: tuple | None = None
        self.load_s = 0.0  # readying the engines for the current run: a reload, or a build
        self.runs = 0

    def stop(self) -> None:
        self.stopping = True
        if self.current is not None:
            self.current.stop()

    async def serve(self) -> None:
        joined = ""
        try:
            while not self.stopping:
                note = announced(self.standby)
                if note is None or note["id"] == joined:
                    await asyncio.sleep(POLL_S)
                    continue
                joined = note["id"]
                await self.membership(note)
        finally:
            self.close_engines()
        log.info("standby worker leaves after %d runs", self.runs)

    async def membership(self, note: dict) -> None:
        """Join the announced run, serve it until it ends or is withdrawn, then leave."""
        try:
            run = RunDir.open(note["run_dir"])
            policies = self.policies or list(run.config.policy_names)
        except (ConfigError, OSError) as e:
            log.error("cannot join the run announced in %s: %s", self.standby / ANNOUNCEMENT, e)
            return
        try:
            await self.ready_engines(run, policies)
        except Exception:  # noqa: BLE001 - a model it cannot load must not end a standing worker
            log.exception("cannot load %s's models; waiting for the next run", run.path)
            self.close_engines()
            return
        if self.stopping:
            return
        log.info("joining %s", run.path)
        self.current = RolloutWorker(run, policies, self.base_id, engines=self.engines)
        self.current.engine_load_s = self.load_s
        session = asyncio.get_running_loop().create_task(self.current.run())
        try:
            while not session.done():
                await asyncio.wait([session], timeout=POLL_S)
                if not self.current.stopping and (announced(self.standby) or {}).get("id") != note["id"]:
                    self.current.stop()  # withdrawn or replaced: hand back and leave
            session.result()
            self.runs += 1
        except Exception:  # noqa: BLE001 - one run's failure must not end a standing worker
            log.exception("left %s after an error; its engines are rebuilt for the next run", run.path)
            self.close_engines()
        finally:
            self.current = None

    async def ready_engines(self, run: RunDir, policies: list[str]) -> None:
        """Reuse the engines with the run's starting weights, or build them for this run."""
        cfg = run.config
        key = (cfg.engine, cfg.model, tuple(policies))
        t0 = time.perf_counter()
        if self.engines is not None and key == self.engine_key:
            for p, engine in self.engines.items():
                await engine.load_weights(policy_model_dir(run.path, cfg, p), 0)
            how = "kept, starting weights loaded"
        else:
            self.close_engines()
            # built on the event loop's thread, like a plain worker's (vLLM's CPU backend
            # checks the OpenMP threads of the thread that built it); nothing else runs yet
            self.engines, self.engine_key = build_engines(run, policies), key
            how = "built"
        self.load_s = time.perf_counter() - t0
        log.info("engines %s for %s in %.2f s", how, run.path, self.load_s)

    def close_engines(self) -> None:
        for engine in (self.engines or {}).values():
            engine.close()
        if self.engines is not None:
            gc.unfreeze()  # `build_engines` froze them: their cycles are garbage now
        self.engines = self.engine_key = None


def run_standby(standby: str, policies: list[str], base_id: str) -> None:
    worker = StandbyWorker(private_dir(Path(standby)), policies, base_id)
    run_until_stopped(worker.stop, worker.serve)
