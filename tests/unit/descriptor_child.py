"""The child process of tests/unit/test_shard_descriptors.py: a dataflow rank's state or store
under a real open-file limit (RLIMIT_NOFILE, set here, in a process of its own so that the test
runner keeps its limit), printing what it saw as one JSON line.

    python -m tests.unit.descriptor_child MODE RUN_DIR LIMIT

MODE:
  serve    recover the rank's state, serve every stored sample in one batch, check each
           sample's CRC32 against the one its sender computed;
  squeeze  recover the store with every descriptor but three taken (the store itself must give
           its own back to open the next shards);
  starve   read a sample back with every descriptor taken, then again once they are free.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

from astraflow.bench.payload import payload_crc
from astraflow.config.rundir import RunDir
from astraflow.dataflow.state import DataflowState, store_options
from astraflow.protocol import messages as m
from astraflow.store.reader import ShardUnavailable
from astraflow.store.shards import ShardStore
from astraflow.store.writer import list_shards


def take_descriptors(leave: int) -> list[int]:
    """Open /dev/null until the limit is reached, then give `leave` back."""
    taken: list[int] = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for fd in taken[len(taken) - leave:]:
        os.close(fd)
    return taken[:len(taken) - leave]


def serve(run: RunDir) -> dict:
    state = DataflowState(run.path, run.config, clock=lambda: 1000.0)
    state.recover()
    n = state.buffers["policy"].buffered
    reply = state.handle(m.Batch("policy", 1, n, 0, 1, 0))
    trajs = reply.trajectories
    bad = sum(payload_crc(t.tokens, t.logprobs) != t.meta["crc"] for t in map(trajs.trajectory, range(len(trajs))))
    store = state.handle(m.Status()).status["store"]
    state.close()
    return {"served": len(trajs), "bad": int(bad), "quarantined": store["quarantined"],
            "open_shards": store["open_shards"], "retries": store["retries"]}


def squeeze(run: RunDir) -> dict:
    store = ShardStore(run.path / "shards", run.config.policy_names, store_options(run.config))
    held = take_descriptors(leave=3)
    recovered = [(idx, len(rows["sample_id"])) for idx, _, rows in store.recover()]
    store.close()
    for fd in held:
        os.close(fd)
    return {"recovered": len(recovered), "rows": sum(n for _, n in recovered), "quarantined": store.quarantined,
            "retries": store.retries}


def starve(run: RunDir) -> dict:
    store = ShardStore(run.path / "shards", run.config.policy_names, store_options(run.config))
    held = take_descriptors(leave=0)
    try:
        store.read([(0, 0)])
        error = None
    except ShardUnavailable as e:
        error = {"kind": e.kind, "errno": e.errno, "message": str(e)}
    for fd in held:
        os.close(fd)
    (again,) = store.read([(0, 0)])
    store.close()
    return {"error": error, "read_after": again["sample_id"], "quarantined": store.quarantined,
            "shards": len(list_shards(run.path / "shards"))}


def main() -> None:
    mode, run_dir, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    run = RunDir.open(run_dir)
    print(json.dumps({"serve": serve, "squeeze": squeeze, "starve": starve}[mode](run)))


if __name__ == "__main__":
    main()
