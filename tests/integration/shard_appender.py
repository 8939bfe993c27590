"""A real shard writer in a process of its own, for SWMR tests: it appends batches of random
trajectories to one shard and flushes after each, as the dataflow rank does (one flush per
turn), then closes the shard. It prints `ready` once the shard is open in SWMR mode.

    python -m tests.integration.shard_appender SHARD BATCHES [ROWS_PER_BATCH]
"""
from __future__ import annotations

import sys
from pathlib import Path

from astraflow.store.writer import ShardWriter, StoreOptions
from tests.conftest import STORE_POLICIES, make_batch


def main() -> None:
    path, batches = Path(sys.argv[1]), int(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    # small chunks: the token datasets grow a chunk every few flushes, as a long run's do
    writer = ShardWriter(path, STORE_POLICIES, StoreOptions(chunk_tokens=4096))
    print("ready", flush=True)
    for i in range(batches):
        writer.stage(make_batch(i * rows, rows, tokens=40 + i % 50))
        writer.flush()
    writer.close()


if __name__ == "__main__":
    main()
