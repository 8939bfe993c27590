"""Who is in which collective weight group of a launch: set by the launcher, read by the members.

Per policy one group: rank 0 its trainer's rank 0, ranks 1..n the rollout workers hosting the
policy, in worker order (a het job: its rollout tasks, in task order). The local launcher and
a het job's tasks (`slurm/node.py`) give each component its memberships in an environment
variable (`launch_env`; nothing when `weights.channel` is `filesystem`); only a component's
first start joins (`membership`): a restarted member cannot rejoin the group its earlier
incarnation left. Members meet through a `FileStore` in the run's `rendezvous/` (on a cluster:
the shared filesystem, which must support file locks). No torch here: the launcher imports it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

GROUPS_ENV = "ASTRAFLOW_WEIGHT_GROUPS"  # JSON {policy: [rank, world]}: this component's memberships


def launch_env(cfg, worker_index: int | None = None, workers: int | None = None) -> dict[str, str]:
    """The memberships of a launch's trainers (`worker_index` None: rank 0 of each policy's
    trainer) or of rollout worker `worker_index`, as the environment variable that carries them.
    `workers`: the rollout workers started with the trainers (default `rollout.workers`; a het
    job: its rollout tasks)."""
    if cfg.weights.channel == "filesystem":
        return {}
    groups = {}
    for policy in cfg.policy_names:
        hosts = [i for i in range(cfg.rollout.workers if workers is None else workers)
                 if policy in cfg.worker_policies(i)]
        if hosts and (worker_index is None or worker_index in hosts):
            groups[policy] = [0 if worker_index is None else 1 + hosts.index(worker_index), 1 + len(hosts)]
    return {GROUPS_ENV: json.dumps(groups)} if groups else {}


def membership(policy: str) -> tuple[int, int] | None:
    """(rank, world) of this process in `policy`'s group; None: not a member (or a restart)."""
    if os.environ.get("ASTRAFLOW_START", "0") != "0":
        return None
    rank, world = json.loads(os.environ.get(GROUPS_ENV, "{}")).get(policy, (None, None))
    return None if rank is None else (int(rank), int(world))


def store_path(run_path: Path, policy: str) -> Path:
    return Path(run_path) / "rendezvous" / f"weights-{policy}-{os.environ.get('ASTRAFLOW_SESSION', 'manual')}"
