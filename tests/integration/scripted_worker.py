"""A scripted rollout worker for integration tests: real process, real protocol, no model.

It leases tasks, commits a group of random trajectories per task and appends every
acknowledgement to a ledger file (one JSON line per ack, flushed), the client-side record
the tests compare with the shards. It follows a restarted dataflow rank (new address in the
rendezvous file) and re-registers when the rank no longer knows it. Commits are retried
until acknowledged (the dataflow rank recognises a retried commit by task id), or dropped
when the task went to another worker meanwhile (`not_holder`, after a restart of the rank).

    python -m tests.integration.scripted_worker RUN_DIR --base w1 --ledger FILE [--hold-after N]
"""
from __future__ import annotations

import argparse
import json
import time
import zlib

import numpy as np

from astraflow.bench.payload import random_trajectory
from astraflow.config.rundir import RunDir
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, read_rendezvous
from astraflow.protocol.codec import RemoteError


class Worker:
    def __init__(self, run_dir: str, base: str, timeout_s: float) -> None:
        self.run_dir, self.base = run_dir, base
        self.secret = RunDir.open(run_dir).read_secret()
        self.client = Client(read_rendezvous(run_dir)["address"], self.secret, timeout_s=timeout_s)
        self.worker_id = ""

    def call(self, make_request):
        """Call until answered: follow restarts, re-register when forgotten."""
        while True:
            try:
                if not self.worker_id:
                    self.worker_id = self.client.call(
                        m.Register(m.PROTOCOL_VERSION, self.base, ["policy"], capacity=2, partition="test")).worker_id
                return self.client.call(make_request())
            except TimeoutError:
                self.client.reconnect(read_rendezvous(self.run_dir)["address"])
            except RemoteError as e:
                if e.code != "unknown_worker":
                    raise
                self.worker_id = ""
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--base", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--hold-after", type=int, default=-1, help="after N commits, lease tasks and hang")
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    w = Worker(args.run_dir, args.base, args.timeout)
    rng = np.random.default_rng(zlib.crc32(args.base.encode()))
    commits = 0
    with open(args.ledger, "a") as ledger:
        while True:
            reply = w.call(lambda: m.Lease(w.worker_id, 2))
            if not reply.tasks:
                if reply.reason == "exhausted":
                    return
                time.sleep(0.05)
                continue
            if 0 <= args.hold_after <= commits:
                time.sleep(3600)  # holds its leases until killed
            for task in reply.tasks:
                trajs = m.TrajectoryBatch.from_trajectories(
                    [random_trajectory(rng, "policy", args.tokens, prompt_tokens=4, group_id=task.task_id)
                     for _ in range(task.group_size)])
                try:
                    ack = w.call(lambda: m.Commit(w.worker_id, task.task_id, trajs))
                except RemoteError as e:
                    if e.code != "not_holder":
                        raise
                    continue  # leased again, to another worker, after the rank restarted: its commit counts
                ledger.write(json.dumps({"task": task.task_id, "status": ack.status, "sids": ack.sample_ids,
                                         "crc": [x["crc"] for x in trajs.meta]}) + "\n")
                ledger.flush()
                commits += 1


if __name__ == "__main__":
    main()
