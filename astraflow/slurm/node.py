"""`astraflow node`: what each task of the heterogeneous Slurm step runs.

`srun --het-group=0,1,2 --mpi=pmi2 --kill-on-bad-exit=0 astraflow node ...` starts one of
these per task. After the MPI bootstrap (see bootstrap.py) each becomes the supervisor of
its role's component, restarting it with backoff like the local launcher does:
- het group 0: the dataflow rank (its task also prepares the model, watches for the end of
  the run, evaluates and writes `summary.json`, and runs the elastic controller);
- het group 1: one trainer rank per task, `trainer.world` consecutive tasks per policy; a
  group's torch.distributed store is a TCP store at its rank 0's node and port, published in
  the bootstrap records (endpoint.py); the ranks of a group restart together through a
  `GroupGeneration` in `rendezvous/`;
- het group 2: one rollout worker per task, id `<job>.<procid>`, supervised like an array
  task's (`arrays.supervise_rollout`).
With `weights.channel` collective (or auto), each policy's trainer rank 0 and the rollout
tasks hosting the policy form its collective weight group (`weights/groups.py`); workers
added later by arrays follow the filesystem.
The run is over when every trainer has done its steps: the dataflow task writes
`rendezvous/finished` and every task stops. SIGUSR1 (Slurm's warning before preemption or
the time limit) and SIGTERM are forwarded to the components — trainers checkpoint, workers
hand back their leases — and the task exits; a requeued job resumes from the run directory.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from astraflow.config.rundir import RunDir
from astraflow.launch import components
from astraflow.launch.inputs import open_run_checked
from astraflow.launch.summary import write_summary
from astraflow.launch.supervisor import EXIT_STOPPED, ComponentFailed, GroupGeneration, Supervisor
from astraflow.protocol.client import wait_rendezvous
from astraflow.slurm.arrays import supervise_rollout
from astraflow.slurm.bootstrap import bootstrap
from astraflow.slurm.elastic import ElasticController
from astraflow.slurm.endpoint import MASTER_ENV, endpoint, group_master
from astraflow.slurm.env import SlurmTask, current_task
from astraflow.slurm.watch import STOP_TIMEOUT_S, Watch
from astraflow.weights.groups import launch_env as weight_groups

log = logging.getLogger(__name__)

STATUS_EVERY_S = 2.0


class Node:
    def __init__(self, task: SlurmTask, config: str | None, run_dir: str, overrides: list[str]) -> None:
        self.task, self.config, self.run_dir, self.overrides = task, config, run_dir, overrides
        self.sup: Supervisor | None = None
        self.peers: list[dict] = []
        self.watch: Watch | None = None
        self.started = time.time()

    # ------------------------------------------------------------ bootstrap
    def run(self) -> int:
        me = {"procid": self.task.procid, "group": self.task.het_group, "role": self.task.role,
              "partition": self.task.partition, "node": self.task.node}
        if self.task.role == "trainer":
            me.update(endpoint())  # where this task's group rendezvouses, if it is its rank 0
        os.environ["ASTRAFLOW_PARTITION"] = self.task.partition  # what the components report
        self.peers, info = bootstrap(me, self.lead)
        if "error" in info:
            log.error("start-up failed on the dataflow task: %s", info["error"])
            return 1
        if info["finished"]:
            log.info("run %s is already finished", info["run_dir"])
            return 0
        os.environ["ASTRAFLOW_SESSION"] = info["session"]
        run = RunDir.open(info["run_dir"])
        role = {"dataflow": self.dataflow_task, "trainer": self.trainer_task, "rollout": self.rollout_task}
        try:
            return role[self.task.role](run)
        except ComponentFailed as e:
            log.error("%s", e)
            return 1
        finally:
            if self.sup is not None:
                self.sup.stop(timeout_s=STOP_TIMEOUT_S)

    def lead(self, peers: list[dict]) -> dict:
        """Rank 0 only: open the run, check the step's shape, prepare, start the dataflow rank."""
        if self.task.role != "dataflow":
            raise RuntimeError(f"rank 0 must be the dataflow task (het group 0), not {self.task.role}")
        # the job script names the submitted config for a run directory it has to create; one
        # that `astraflow-launch` created (with its --set) is resumed as it is, also on a requeue
        created = (Path(self.run_dir) / "config.yaml").exists()
        run = open_run_checked(self.run_dir, None if created else self.config, self.overrides)
        cfg = run.config
        trainers = sum(p["role"] == "trainer" for p in peers)
        if trainers != cfg.trainer.world * len(cfg.policy_names):
            raise RuntimeError(f"het group 1 has {trainers} tasks; the config needs trainer.world × policies "
                               f"= {cfg.trainer.world} × {len(cfg.policy_names)}")
        session = f"slurm-{self.task.job_id}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
        record = {"job_id": self.task.job_id, "session": session, "time": time.time(), "tasks": peers}
        (run.path / "rendezvous" / f"job-{self.task.job_id}.json").write_text(json.dumps(record, indent=1))
        finished = (run.path / "summary.json").exists()
        if not finished:
            components.prepare(run)
            self.sup = Supervisor(cfg.launcher.max_restarts, cfg.launcher.backoff_s)
            t0 = time.time()
            rank = self.sup.add(components.dataflow(run, local=False)).name
            wait_rendezvous(run.path, timeout_s=120, newer_than=t0, alive=lambda: self.sup.check_starting(rank))
        return {"run_dir": str(run.path.resolve()), "session": session, "finished": finished}

    # ------------------------------------------------------------ roles
    def dataflow_task(self, run: RunDir) -> int:
        t_components = time.time()
        last: dict = {}
        next_status = 0.0

        def done(_: list[str]) -> bool:
            nonlocal last, next_status
            if time.monotonic() < next_status:
                return False
            next_status = time.monotonic() + STATUS_EVERY_S
            try:
                last = components.dataflow_status(run)
            except TimeoutError:  # the rank is restarting: ask again later
                return False
            return components.trainers_done(run, last)

        controller = None
        if run.config.elastic.enabled:
            rollout_partition = next((p["partition"] for p in self.peers if p["role"] == "rollout"), "")
            controller = ElasticController(run, rollout_partition)
            controller.start()
        ident = components.invite_standby(run)
        try:
            if not self.supervise(done):
                components.dismiss_standby(run, ident)
                if self.watch.signal == signal.SIGUSR1:  # a warning: let the others leave first
                    components.wait_workers_left(run)
                    # a trainer mid-step needs the rank to acknowledge it before it checkpoints
                    # (stopped 11 ms after the warning, a run lost its stop checkpoint)
                    components.wait_trainers_stopped(run, STOP_TIMEOUT_S)
                return EXIT_STOPPED
        finally:
            if controller is not None:
                controller.stop()
        components.finished_marker(run.path).write_text(json.dumps({"time": time.time(), "job": self.task.job_id}))
        components.dismiss_standby(run, ident)
        components.wait_workers_left(run)
        try:
            last = components.dataflow_status(run)  # after the workers' last commits: the counts are final
        except TimeoutError:  # the rank is gone: the last status it gave
            pass
        self.sup.stop(timeout_s=STOP_TIMEOUT_S)
        summary = write_summary(run, last, self.started, t_components, time.time())
        log.info("run finished: %s", json.dumps({k: summary.get(k) for k in ("steps", "reward_last", "eval_accuracy")}))
        return 0

    def trainer_task(self, run: RunDir) -> int:
        cfg = run.config
        world = cfg.trainer.world
        index, rank = divmod(self.task.group_rank, world)
        policy = cfg.policy_names[index]
        self.sup = Supervisor(cfg.launcher.max_restarts, cfg.launcher.backoff_s)
        generation = GroupGeneration(run.path / "rendezvous", f"torch-{policy}-{os.environ['ASTRAFLOW_SESSION']}")
        env = weight_groups(cfg, workers=self.rollout_tasks)
        if world > 1:
            env[MASTER_ENV] = group_master(self.peers, index, world)
        comp = self.sup.add(components.trainer(run, policy, [rank], world, generation if world > 1 else None, env=env))
        marker = components.finished_marker(run.path)
        return 0 if self.supervise(lambda finished: comp.name in finished or marker.exists()) else EXIT_STOPPED

    def rollout_task(self, run: RunDir) -> int:
        policies = run.config.worker_policies(self.task.group_rank)
        env = weight_groups(run.config, self.task.group_rank, self.rollout_tasks)
        return 0 if supervise_rollout(run, f"{self.task.job_id}.{self.task.procid}", policies, env) else EXIT_STOPPED

    @property
    def rollout_tasks(self) -> int:
        """The step's rollout tasks: the workers of the collective weight groups."""
        return sum(p["role"] == "rollout" for p in self.peers)

    def supervise(self, done) -> bool:
        self.watch = Watch(self.sup)
        return self.watch.until(done)


def run_node(config: str | None, run_dir: str, overrides: list[str]) -> int:
    return Node(current_task(), config, run_dir, overrides).run()
