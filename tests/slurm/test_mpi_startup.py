"""MPI start-up (`astraflow.slurm.bootstrap`) under Slurm's pmi2 plugin, on the real cluster.

The plugin takes each PMI-1 request in one `read()` of at most 1024 bytes (Slurm 22.05
`pmi1.c`); a longer `put` line arrives in two pieces, both rejected, and `MPI_Init` fails
or hangs. So every line a rank sends must stay short whatever the rank's environment and
heap. And libfabric's `sockets` provider now and then never finishes the exchange between
two ranks on one node, so start-up runs on its `tcp` provider. This runs the bootstrap in a
het step shaped like the job's (two rollout tasks on one node), with MPICH tracing its PMI
traffic (`PMI_DEBUG`) and naming its provider (`MPIR_CVAR_DEBUG_SUMMARY`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from astraflow.slurm.bootstrap import STARTUP_ENV
from tests.conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

TASKS = (("cpu", 1), ("gpu-h100", 1), ("gpu-a100", 2))  # the het groups' order, as in the job script
# A business card of at most 64 bytes (FI_NAME_MAX) is 128 hex characters; with
# "cmd=put kvsname=<job>.<step> key=-allgather-1-<rank> value=" a put line stays under 256.
# A card that does not fit (MPICH's UCX card: 4096 bytes of address and heap, in 9
# segments) gives lines of up to 1078 bytes whose length varies with the heap.
PUT_LINE_BOUND = 256
# each rank reports, after the bootstrap, what of STARTUP_ENV its environment still holds
BOOTSTRAP = ("import os; from astraflow.slurm.bootstrap import STARTUP_ENV, bootstrap; "
             "peers, info = bootstrap({'procid': int(os.environ['SLURM_PROCID'])}, lambda p: {'ranks': len(p)}); "
             "print('bootstrapped', os.environ['SLURM_PROCID'], info['ranks'], "
             "sorted(set(STARTUP_ENV) & set(os.environ)), flush=True)")


def test_mpi_startup_sends_short_pmi_lines_over_tcp_and_leaves_the_environment_as_it_was():
    components = [["-p", p, "-N1", f"-n{n}", "-c1", sys.executable, "-c", BOOTSTRAP] for p, n in TASKS]
    srun = ["timeout", "90", "srun", "--mpi=pmi2", *components[0], ":", *components[1], ":", *components[2]]
    env = {k: v for k, v in os.environ.items() if k not in STARTUP_ENV}
    done = subprocess.run(srun, capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**env, "PMI_DEBUG": "1", "MPIR_CVAR_DEBUG_SUMMARY": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"the start-up step failed or hung (rc {done.returncode}):\n{done.stderr[-3000:]}"
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("bootstrapped")) == [
        f"bootstrapped {r} 4 []" for r in range(4)], done.stdout[-3000:]

    assert re.search(r"^libfabric provider: tcp\b", out, re.M), "MPI did not start on libfabric's tcp provider"
    puts = re.findall(r"send to fd=\d+ pmi: (cmd=put .*)", out)
    assert len(puts) >= 3, "no PMI put traced: MPICH's PMI_DEBUG output changed?"
    longest = max(puts, key=len)
    print(f"{len(puts)} PMI put lines, the longest {len(longest)} bytes")
    assert len(longest) < PUT_LINE_BOUND, f"a {len(longest)}-byte PMI line: {longest[:120]}..."
