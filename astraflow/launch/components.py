"""The run's components as supervised commands, shared by the local launcher and Slurm nodes.

Every component is a `python -m astraflow.cli.main ...` child process, so a launcher never
imports torch. `ASTRAFLOW_SESSION` names one launch of a run (a local `astraflow run`, one
Slurm job or requeue): trainer groups rendezvous under it, so files left in
`rendezvous/` by an earlier launch are never reused.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from astraflow.config.rundir import RunDir
from astraflow.launch.supervisor import Component, GroupGeneration, log_ending
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, wait_rendezvous
from astraflow.rollout import invitation

FINISHED_FILE = "finished"  # in rendezvous/: written once every trainer has done its steps


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "astraflow.cli.main", *args]


def start_prepare(run: RunDir) -> subprocess.Popen:
    """Start building (and warming up) the run's model, once per run: a no-op when it exists."""
    with open(run.path / "logs" / "prepare.log", "a") as out:
        return subprocess.Popen(cli("prepare", "--run-dir", str(run.path)), stdout=out, stderr=subprocess.STDOUT)


def finish_prepare(run: RunDir, preparing: subprocess.Popen) -> None:
    """Wait for `start_prepare`'s process; raises SystemExit naming the log on failure."""
    if preparing.wait() != 0:
        log = run.path / "logs" / "prepare.log"
        raise SystemExit(f"model preparation failed, see {log}{log_ending(log)}")


def prepare(run: RunDir) -> None:
    finish_prepare(run, start_prepare(run))


def dataflow(run: RunDir, local: bool) -> Component:
    cmd = cli("dataflow", "--run-dir", str(run.path), *(["--local"] if local else []))
    return Component("dataflow", [cmd], run.path / "logs")


def trainer(run: RunDir, policy: str, ranks: list[int], world: int,
            generation: GroupGeneration | None = None, env: dict[str, str] | None = None) -> Component:
    """The ranks of `policy`'s trainer group that this supervisor runs (all of them locally);
    `env`: more environment for each."""
    cmd = cli("train", "--run-dir", str(run.path), "--policy", policy)
    name = f"trainer-{policy}" + (f"-r{ranks[0]}" if len(ranks) < world else "")
    envs = [{"ASTRAFLOW_RANK": str(r), "ASTRAFLOW_WORLD": str(world), **(env or {})} for r in ranks]
    return Component(name, [cmd] * len(ranks), run.path / "logs", env=envs, generation=generation)


def rollout(run: RunDir, name: str, worker_id: str, policies: tuple[str, ...],
            env: dict[str, str] | None = None) -> Component:
    cmd = cli("rollout", "--run-dir", str(run.path), "--worker-id", worker_id, "--policies", *policies)
    return Component(name, [cmd], run.path / "logs", env=[env or {}])


def dataflow_status(run: RunDir, timeout_s: float = 10.0) -> dict:
    client = Client(wait_rendezvous(run.path, timeout_s)["address"], run.read_secret(), timeout_s=timeout_s)
    try:
        return client.call(m.Status()).status
    finally:
        client.close()


def wait_workers_left(run: RunDir, timeout_s: float = 10.0) -> None:
    """Give the rollout workers, told to leave (end marker, withdrawn invitation, SIGTERM), a
    moment to hand their leases back to the rank before it stops."""
    _wait_status(run, lambda status: status["workers"]["alive"] == 0, timeout_s)


def wait_trainers_stopped(run: RunDir, timeout_s: float) -> None:
    """After a stop signal: give each trainer that has said `Ready` the time to finish its step
    (the rank acknowledges it), checkpoint and say `Stopped` before the rank stops."""
    _wait_status(run, lambda status: trainers_stopped(run, status), timeout_s)


def trainers_stopped(run: RunDir, status: dict) -> bool:
    """Every policy's trainer stopped (`Stopped`), done, or never ready in this rank's life."""
    trainers = {p: status["policies"][p]["trainer"] for p in run.config.policy_names}
    return all(t is None or "stopped_step" in t or _trainer_done(run, status, p) for p, t in trainers.items())


def _wait_status(run: RunDir, ok: Callable[[dict], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ok(dataflow_status(run, timeout_s=2.0)):
                return
        except TimeoutError:
            return  # the rank is gone: nobody left to tell
        time.sleep(0.1)


def invite_standby(run: RunDir) -> str:
    """Announce the run (its rank is up) to the config's standby workers; the invitation id, or ""."""
    standby = run.config.rollout.standby
    return invitation.announce(Path(standby), run.path) if standby else ""


def dismiss_standby(run: RunDir, ident: str) -> None:
    """Withdraw the run's invitation: its standby workers hand their leases back and leave
    (`wait_workers_left` waits for that, and for the run's own workers)."""
    if ident:
        invitation.withdraw(Path(run.config.rollout.standby), ident)


def trainers_done(run: RunDir, status: dict) -> bool:
    return all(_trainer_done(run, status, p) for p in run.config.policy_names)


def _trainer_done(run: RunDir, status: dict, policy: str) -> bool:
    return status["policies"][policy]["trainer_step"] >= run.config.trainer_for(policy).steps


def finished_marker(run_path: Path) -> Path:
    return run_path / "rendezvous" / FINISHED_FILE
