"""`astraflow run CONFIG`: every component as a supervised local process on one machine.

Everything starts at once: the model's preparation (built from config and warmed up, once
per run directory, in a child process — the launcher itself never imports torch), the
dataflow rank, one trainer per policy (`trainer.world` ranks each), `rollout.workers`
rollout workers and the evaluation. They import their libraries (vLLM: ~7 s of CPU) while
the model is prepared, then wait for it (`models.wait_for_model`): started after the
preparation, the quickstart's worker served 22 s into the run; started with it, 14-15 s.
The run ends when every trainer has finished its steps; then the evaluation scores the
starting and the last published weights greedily on the held-out prompts while the workers
and the dataflow rank stop, and `RUN_DIR/summary.json` is written.
`astraflow run --run-dir EXISTING` resumes a run: every component picks up from the run
directory (shards, journal, checkpoints).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from astraflow.launch import components
from astraflow.launch.inputs import open_run_checked
from astraflow.launch.progress import Progress
from astraflow.launch.summary import start_eval, training_done, write_summary
from astraflow.launch.supervisor import ComponentFailed, Supervisor
from astraflow.protocol.client import wait_rendezvous
from astraflow.weights.groups import launch_env as weight_groups

POLL_S = 0.1  # how soon the launcher notices that the last trainer has exited


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _cancel(*children: subprocess.Popen | None) -> None:
    """Kill the children the launcher started beside the supervised components (the
    preparation, the evaluation), those that were started."""
    for child in children:
        if child is not None:
            child.kill()
            child.wait()


def run_local(config: str | None, run_dir: str | None, overrides: list[str], quiet: bool = False) -> dict:
    # Ctrl-C and SIGTERM stop the run cleanly (resumable), also when it was started in the
    # background, where a shell leaves SIGINT ignored (a chaos test's Ctrl-C did nothing there)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    if run_dir is None:
        if config is None:
            raise SystemExit("astraflow run: give a config file or --run-dir of an existing run")
        run_dir = f"runs/{Path(config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = open_run_checked(run_dir, config, overrides)
    cfg = run.config
    started = time.time()
    os.environ["ASTRAFLOW_SESSION"] = f"local-{os.getpid()}-{int(started)}"
    sup = Supervisor(cfg.launcher.max_restarts, cfg.launcher.backoff_s)
    trainers: list[str] = []
    workers: list[str] = []
    ident = ""
    evaluation = None
    preparing = components.start_prepare(run)
    t_components = time.time()
    try:
        rank = sup.add(components.dataflow(run, local=True)).name
        wait_rendezvous(run.path, timeout_s=60, newer_than=t_components, alive=lambda: sup.check_starting(rank))
        trainers = [sup.add(components.trainer(run, p, list(range(cfg.trainer.world)), cfg.trainer.world,
                                               env=weight_groups(cfg))).name for p in cfg.policy_names]
        workers = [sup.add(components.rollout(run, f"rollout-{i}", f"local-{i}", cfg.worker_policies(i),
                                              env=weight_groups(cfg, i))).name for i in range(cfg.rollout.workers)]
        # it imports its engine now and scores when training is done (`training_done`)
        evaluation = start_eval(run, alongside=True)
        progress = Progress(run, quiet)
        progress.phase = "preparing the model (build and warm-up, once per run)"
        while preparing.poll() is None:
            progress.update()
            time.sleep(POLL_S)
        progress.phase = ""
        components.finish_prepare(run, preparing)
        ident = components.invite_standby(run)  # standby workers load the prepared model at once
        remaining = set(trainers)
        while remaining:
            remaining -= set(sup.poll())
            progress.update()
            time.sleep(POLL_S)
        progress.close()
    except (ComponentFailed, SystemExit) as e:  # a component, or the model's preparation, failed
        _cancel(preparing, evaluation)
        components.dismiss_standby(run, ident)
        sup.stop()
        raise SystemExit(f"astraflow run: {e}") from None
    except KeyboardInterrupt:
        _cancel(preparing, evaluation)
        components.dismiss_standby(run, ident)
        sup.stop(workers)
        components.wait_workers_left(run)
        # then the trainers: one in the middle of a step finishes it (the rank acknowledges its
        # samples) and checkpoints. Stopped together with the rank, a trainer mid-step left no
        # stop checkpoint (a chaos run: v11 published, step 9 the newest checkpoint)
        sup.stop(trainers)
        sup.stop()
        raise SystemExit(f"astraflow run: interrupted; resume with `astraflow run --run-dir {run.path}`") from None
    training_done(evaluation)  # it reads only the published weights: it runs while the rest stops
    # workers first, so that they hand their leases back to a rank still listening
    components.dismiss_standby(run, ident)
    sup.stop(workers)
    components.wait_workers_left(run)
    status = components.dataflow_status(run)  # after the workers' last commits: the counts are final
    sup.stop()
    return write_summary(run, status, started, t_components, time.time(), evaluation)
