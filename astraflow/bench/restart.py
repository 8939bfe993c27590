"""`astraflow bench restart`: a dataflow rank's memory and restart time with N stored trajectories.

Set-up: a run directory whose shards hold `stored` short trajectories (groups of `GROUP`,
`tokens` tokens each), written through the real shard writer in large batches rather than
commit by commit (the commit path has its own benchmark, `bench dataflow`), and a journal in
which a trainer consumed `consumed` of them, `BATCH` per step, as the rank journals them.

Measured: a fresh `astraflow dataflow` process on that directory — seconds from its start
until it answers `Status` (recovery: every shard's rows and the whole journal), its peak RSS
(from its own status), and the counts it recovered, which must equal what was written. With
`compact`, the compaction process runs first (timed) and the rank resumes from the compact
state: it reads only the newest shard (the one compaction leaves, as it may be growing)
and verifies the others; `shard_mb` sets how often the shards rotate. Run it
as a benchmark: 10 M stored trajectories take a few minutes to write and ~2 GB of disk.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from astraflow.config.rundir import RunDir
from astraflow.dataflow.recovery import COMPACT_STATE
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from astraflow.protocol.client import Client, wait_rendezvous
from astraflow.store.schema import TOKEN_COLUMNS
from astraflow.store.writer import RowBatch

GROUP = 8
BATCH = 256
WRITE_ROWS = 1 << 17  # rows per writer batch

CONFIG = """
run: {{name: bench-restart, seed: 0}}
dataflow: {{interface: loopback}}
store: {{shard_max_mb: {shard_mb}}}
tasks: {{kind: arithmetic, group_size: {group}, heldout: 0, max_operand: 40}}
trainer: {{steps: {steps}, batch_size: {batch}}}
policies:
  - {{name: policy, max_staleness: 1000000, buffer_capacity: {capacity}, filter_zero_advantage: false}}
"""


def _rows(first: int, n: int, tokens: int, rng: np.random.Generator) -> RowBatch:
    sids = np.arange(first, first + n, dtype=np.int64)
    length = np.full(n, tokens, np.int32)
    total = n * tokens
    token_cols = {"tokens": rng.integers(0, 32, total, dtype=np.int32), "logprobs": np.zeros(total, np.float32),
                  "loss_mask": np.ones(total, np.uint8), "versions": np.zeros(total, np.int32),
                  "token_policy": np.zeros(total, np.int8)}
    assert set(token_cols) == set(TOKEN_COLUMNS)
    rows = {"sample_id": sids, "task_id": sids // GROUP, "episode_id": sids, "group_id": sids // GROUP,
            "policy": np.zeros(n, np.uint8), "worker": np.full(n, b"bench", dtype="S64"), "length": length,
            "reward": rng.integers(0, 2, n).astype(np.float32), "guided": np.zeros(n, np.uint8),
            "weight": np.ones(n, np.float32), "gen_s": np.zeros(n, np.float32), "t_commit": np.full(n, time.time()),
            "version_min": np.zeros(n, np.int32), "version_max": np.zeros(n, np.int32),
            "version_at_commit": np.zeros(n, np.int32)}
    return RowBatch(token_cols, rows, [b""] * n)


def populate(run: RunDir, stored: int, consumed: int, tokens: int) -> None:
    """Write `stored` trajectories through the shard writer and journal `consumed` of them as
    a trainer's acknowledged steps, as the rank would have."""
    state = DataflowState(run.path, run.config)
    state.recover()
    rng = np.random.default_rng(0)
    for first in range(0, stored, WRITE_ROWS):
        state.store.append(_rows(first, min(WRITE_ROWS, stored - first), tokens, rng))
        state.store.flush()
    state.journal.append("samples", hwm=stored)
    state.journal.append("tasks", hwm=-(-stored // GROUP))
    for step, first in enumerate(range(0, consumed - BATCH + 1, BATCH), start=1):
        ids = list(range(first, first + BATCH))
        state.journal.append("served", policy="policy", step=step, ids=ids)
        state.journal.append("consumed", policy="policy", step=step, ids=ids, tasks=[i // GROUP for i in ids])
    state.journal.flush()
    state.close()


def run_bench(stored: int = 1_000_000, consumed_fraction: float = 0.9, tokens: int = 4, keep: bool = False,
              shard_mb: float = 1024.0, compact: bool = False) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="astraflow-restart-"))
    (tmp / "restart.yaml").write_text(CONFIG.format(group=GROUP, steps=1 << 30, batch=BATCH, capacity=1 << 30,
                                                    shard_mb=shard_mb))
    run = RunDir.create(tmp / "run", tmp / "restart.yaml")
    consumed = int(stored * consumed_fraction) // BATCH * BATCH
    t0 = time.perf_counter()
    populate(run, stored, consumed, tokens)
    populate_s = time.perf_counter() - t0
    shards = list((run.path / "shards").glob("*.h5"))
    disk_mb = sum(p.stat().st_size for p in shards) / 2**20
    journal_mb = (run.path / "journal" / "journal.jsonl").stat().st_size / 2**20
    compacted: dict = {}
    if compact:  # as the rank starts it: its own process, over the shards and journal as they are
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "astraflow.dataflow.compact", str(run.path)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        compacted = {"compact_s": time.perf_counter() - t0,
                     "compact_state_mb": (run.path / "journal" / COMPACT_STATE).stat().st_size / 2**20}
    log = open(run.path / "logs" / "dataflow.log", "w")
    t0 = time.perf_counter()
    rank = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "dataflow", "--run-dir", str(run.path)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        address = wait_rendezvous(run.path, timeout_s=3600)["address"]
        status = Client(address, run.read_secret(), timeout_s=600).call(m.Status()).status
        restart_s = time.perf_counter() - t0
    finally:
        rank.send_signal(signal.SIGTERM)
        rank.wait(timeout=120)
        log.close()
    counts = status["policies"]["policy"]
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"stored": stored, "consumed": consumed, "tokens": tokens, "populate_s": populate_s,
            "shards": len(shards), "shards_mb": disk_mb,
            "journal_mb": journal_mb, **compacted, "restart_to_serving_s": restart_s,
            "recovery_s": status["store"]["recovery"]["s"],
            "from_compact_state": status["store"]["recovery"]["from_compact_state"],
            "dataflow_peak_rss_mb": status["process"]["peak_rss_mb"],
            "recovered": {"stored": counts["stored"], "consumed": counts["consumed"]},
            "recovered_all": counts["stored"] == stored and counts["consumed"] == consumed}
