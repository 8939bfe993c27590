"""`astraflow bench dataflow` serves its consumer for as long as it runs, on the bench's own
config: the rank, driven here directly, hands out a full batch at every step well past the
trainer's default 50 steps, and nothing stored is counted as unused.

Before: the bench's config left `trainer.steps` at 50, so from step 51 on the rank took the
consumer for a finished trainer, counted every new sample as unused, and the consumer waited
out the clock. The bench reported 12,800 trajectories served and verified whatever its
duration (1,280/s in 10 s, 853/s in 15 s) while 3,000-5,000/s were stored."""
from __future__ import annotations

import numpy as np

from astraflow.bench.dataflow import BATCH, GROUP, bench_config, problems
from astraflow.bench.payload import random_trajectory
from astraflow.config.rundir import RunDir
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m

STEPS = 60  # past the default trainer.steps (50)


def test_the_bench_consumer_is_served_a_full_batch_at_every_step(tmp_path):
    (tmp_path / "bench.yaml").write_text(bench_config())
    run = RunDir.create(tmp_path / "run", tmp_path / "bench.yaml")
    state = DataflowState(run.path, run.config, clock=lambda: 1000.0)
    state.recover()
    worker = state.handle(m.Register(m.PROTOCOL_VERSION, "w", ["policy"], BATCH // GROUP)).worker_id
    rng = np.random.default_rng(0)
    state.handle(m.Ready(m.PROTOCOL_VERSION, "policy", 0))
    for step in range(1, STEPS + 1):
        for task in state.handle(m.Lease(worker, BATCH // GROUP)).tasks:
            trajs = [random_trajectory(rng, "policy", 4, prompt_tokens=1, group_id=task.task_id) for _ in range(GROUP)]
            state.handle(m.Commit(worker, task.task_id, m.TrajectoryBatch.from_trajectories(trajs)))
        batch = state.handle(m.Batch("policy", step, BATCH))
        assert batch is not None and len(batch.sample_ids) == BATCH, f"step {step}: no batch"
        state.handle(m.Consumed("policy", step, batch.sample_ids.tolist()))
    counts = state.buffers["policy"].counts
    assert counts["consumed"] == counts["stored"] == STEPS * BATCH and counts["unused"] == 0
    state.close()


def test_a_run_whose_serving_fell_behind_lists_it_as_a_problem():
    """The figures of the runs the docs reported: 12,800 served of 44,976 acknowledged."""
    result = {"trajectories_verified": 12_800, "trajectories_committed": 44_976, "served_vs_committed": 0.28,
              "consumer_longest_wait_s": 11.2, "dataflow_unused": 32_176, "checksum_failures": 0,
              "acknowledged_not_stored": 0}
    found = problems(result)
    assert len(found) == 2 and "serving fell behind storing" in found[0] and "unused" in found[1]
    assert problems({**result, "trajectories_verified": 44_000, "served_vs_committed": 0.98,
                     "dataflow_unused": 0}) == []
