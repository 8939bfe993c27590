"""Where a trainer group's torch.distributed store listens, chosen at start-up.

Before the MPI bootstrap every trainer task reserves a free TCP port on its node's cluster
address and puts both in its bootstrap record; after it, each rank of a policy's trainer
group rendezvouses at its rank 0's (`tcp://address:port`, passed as `MASTER_ENV`): a TCP
store in rank 0's process, nothing on the shared filesystem (a file store relies on file
locks that parallel filesystems do not always give across nodes). The reserving socket is
closed before rank 0 binds the port again; c10d's store binds with SO_REUSEADDR, so a group
that restarts as a whole binds the same port, and each start keeps its keys under its own
prefix (`trainer/loop.py`). Local runs keep their file store.
"""
from __future__ import annotations

import socket

from astraflow.dataflow.address import cluster_address

MASTER_ENV = "ASTRAFLOW_MASTER"  # host:port of the trainer group's store


def endpoint() -> dict[str, object]:
    """This node's cluster address and a port free on it, for the bootstrap record."""
    address = cluster_address() or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return {"address": address, "port": s.getsockname()[1]}


def group_master(peers: list[dict], policy_index: int, world: int) -> str:
    """host:port of rank 0 of the `policy_index`-th policy's trainer group (its `world`
    consecutive trainer tasks), from the bootstrap records."""
    trainers = sorted((p for p in peers if p["role"] == "trainer"), key=lambda p: p["procid"])
    leader = trainers[policy_index * world]
    return f"{leader['address']}:{leader['port']}"
