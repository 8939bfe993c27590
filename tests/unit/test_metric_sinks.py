"""The trainer's metrics sinks: every row to the CSV (what the launcher reads) and to
TensorBoard, a step's best completion as TensorBoard text, and the held-out accuracy beside
the curves once the evaluation is done. Event files are read back record by record."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from tensorboardX.proto import event_pb2

from astraflow.analysis.metrics import read_rows
from astraflow.analysis.sinks import best_completion, open_sinks, record_eval
from astraflow.protocol.messages import TrajectoryBatch
from tests.conftest import make_run


def events(directory: Path) -> list:
    """Every event of the TFRecord files in `directory` (length, crc, data, crc)."""
    out = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            out.append(event_pb2.Event.FromString(data[at + 12:at + 12 + n]))
            at += 12 + n + 4
    return out


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for ev in events(directory):
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((ev.step, round(v.simple_value, 6)))
    return out


def test_rows_reach_the_csv_and_tensorboard_and_eval_joins_them(tmp_path):
    run_dir = make_run(tmp_path)
    run = run_dir.path
    fields = ("step", "time", "reward_mean", "lr")
    sinks = open_sinks(run, "policy", fields, run_dir.config)
    for step in (1, 2):
        row = {"step": step, "time": 100.0 + step, "reward_mean": 0.25 * step, "lr": 0.001}
        sinks.scalars(row, step, row["time"])
    sinks.text("best_completion", "reward 1.000", 2)
    sinks.close()
    assert [r["reward_mean"] for r in read_rows(run / "metrics" / "policy.csv")] == [0.25, 0.5]
    record_eval(run, {"eval": {"policy": {"metric": "accuracy", "base": 0.5, "last": 0.75, "version": 2}}},
                run_dir.config)
    board = run / "metrics" / "tensorboard" / "policy"
    got = scalars(board)
    assert got["policy/reward_mean"] == [(1, 0.25), (2, 0.5)] and got["policy/lr"] == [(1, 0.001), (2, 0.001)]
    assert got["policy/eval_accuracy"] == [(0, 0.5), (2, 0.75)] and "policy/step" not in got
    texts = [v for ev in events(board) for v in ev.summary.value if v.tag.startswith("policy/best_completion")]
    assert texts and b"reward 1.000" in texts[0].tensor.string_val[0]


def test_best_completion_is_the_top_rewarded_trajectory_split_at_its_first_generated_token():
    batch = TrajectoryBatch(policy=["p", "p"], episode_id=np.zeros(2, np.int64), group_id=np.zeros(2, np.int64),
                            reward=np.array([0.0, 1.0], np.float32), gen_s=np.zeros(2, np.float32),
                            lengths=np.array([3, 4], np.int32), tokens=np.arange(1, 8, dtype=np.int32),
                            logprobs=np.zeros(7, np.float32), loss_mask=np.array([0, 1, 1, 0, 0, 1, 1], np.uint8),
                            versions=np.zeros(7, np.int32), token_policy=np.zeros(7, np.int8), meta=[{}, {}])
    text = best_completion(batch, lambda ids: "".join(chr(ord("a") + i) for i in ids))
    assert text.startswith("reward 1.000") and "    ef\n" in text and text.endswith("completion:\n\n    gh")
