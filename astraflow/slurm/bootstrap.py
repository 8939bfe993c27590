"""MPI at start-up only: who is who in the heterogeneous step, and where to find each other.

One `MPI_COMM_WORLD` spans the het groups (mpi4py + the PyPI MPICH wheels, `srun
--mpi=pmi2`). Rank 0 (het group 0, the dataflow rank's task) prepares the run and starts
the dataflow rank, then broadcasts the run's facts (run directory, dataflow address, launch
session); everyone gathers everyone's role, partition and node. Then MPI is finalized while
every rank is still alive: afterwards no rank depends on another through MPI, so one dying
(SIGKILL, a node failure) cannot tear the others down — the components talk over the signed
ZeroMQ protocol and the run directory.

Objects travel as JSON bytes (never pickle), and waiting ranks poll non-blocking requests
with sleeps so that they do not spin a core while rank 0 warms up the model.

MPICH starts on its OFI netmod with libfabric's tcp provider (`STARTUP_ENV`, for `MPI_Init`
only, where the user has not chosen). `MPI_Init` exchanges each rank's business card through
Slurm's pmi2 plugin as PMI-1 `put` lines, and that plugin (Slurm 22.05,
`src/plugins/mpi/pmi2/pmi1.c`) takes a request in one `read()` of at most 1024 bytes while
it grants values of up to 1024 bytes. A longer line reaches it in two pieces, both rejected
("value not properly terminated", "request not begin with 'cmd='"): the value is lost and
the peers' `MPI_Init` fails, or, when the rank's next request is already queued behind the
tail, that request is swallowed too and the rank waits forever for its answer. The UCX
netmod's card is always 4096 bytes (the worker address and the heap memory after it), put in
9 segments whose lines, up to 1078 bytes, vary with that heap from one process to the next;
the OFI card is the endpoint's name, at most 64 bytes (`FI_NAME_MAX`), one line of ~70.
libfabric's default provider here, `sockets`, now and then never completes the exchange
between two ranks on one node (5 of 60 busy start-ups hung; `tcp`: 0 of 60). The settings
are undone once MPI is up: the components must not inherit them (NCCL's OFI plugin, for one,
reads `FI_PROVIDER`).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

GATHER_BYTES = 1024  # per rank, for the all-gather of (role, partition, node)
POLL_S = 0.05
# MPICH and libfabric settings for MPI_Init (see above); a value the user exported wins
STARTUP_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def _wait(request: Any) -> None:
    while not request.Test():
        time.sleep(POLL_S)


@contextmanager
def startup_env() -> Iterator[None]:
    """`STARTUP_ENV` where the environment does not set it, removed again on leaving."""
    added = [name for name in STARTUP_ENV if name not in os.environ]
    os.environ.update({name: STARTUP_ENV[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            del os.environ[name]


def bcast_json(comm: Any, obj: Any, root: int = 0) -> Any:
    data = json.dumps(obj).encode() if comm.Get_rank() == root else b""
    size = np.array([len(data)], dtype=np.int64)
    _wait(comm.Ibcast(size, root=root))
    buf = np.frombuffer(data, dtype=np.uint8).copy() if comm.Get_rank() == root else np.empty(size[0], np.uint8)
    _wait(comm.Ibcast(buf, root=root))
    return json.loads(buf.tobytes())


def allgather_json(comm: Any, obj: Any) -> list[Any]:
    data = json.dumps(obj).encode()
    if len(data) > GATHER_BYTES:
        raise ValueError(f"bootstrap record too large ({len(data)} > {GATHER_BYTES} bytes)")
    send = np.zeros(GATHER_BYTES, np.uint8)
    send[:len(data)] = np.frombuffer(data, np.uint8)
    recv = np.empty(GATHER_BYTES * comm.Get_size(), np.uint8)
    _wait(comm.Iallgather(send, recv))
    return [json.loads(recv[i * GATHER_BYTES:(i + 1) * GATHER_BYTES].tobytes().rstrip(b"\0"))
            for i in range(comm.Get_size())]


def bootstrap(me: dict, lead: Callable[[list[dict]], dict]) -> tuple[list[dict], dict]:
    """All ranks: gather `me` from everyone; rank 0 runs `lead(peers)` and broadcasts its result.

    If `lead` raises, the error is broadcast as `{"error": ...}` so that no rank waits forever.
    """
    import mpi4py

    mpi4py.rc.finalize = False  # finalized explicitly below, while every rank is alive
    with startup_env():
        from mpi4py import MPI  # MPI_Init

    comm = MPI.COMM_WORLD
    try:
        peers = allgather_json(comm, me)
        info: dict = {}
        if comm.Get_rank() == 0:
            try:
                info = lead(peers)
            except (Exception, SystemExit) as e:  # noqa: BLE001 — any failure must reach the peers
                info = {"error": f"{type(e).__name__}: {e}"}
        info = bcast_json(comm, info, root=0)
    finally:
        MPI.Finalize()
    return peers, info
