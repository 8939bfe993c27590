"""`astraflow export`: a run's trajectories as Parquet or JSONL that pandas reads with no
AstraFlow code: one row per trajectory, prompt and completion split at the policy's first
generated token, decoded by the run's own tokenizer with `--text`; the bulk reader behind it
returns what the per-row `load_trajectory` returns."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from astraflow.cli.main import main
from astraflow.models.factory import make_model
from astraflow.models.tokenizer import load_hf_tokenizer
from astraflow.store.reader import iter_trajectories, load_rows, load_trajectory
from astraflow.store.shards import ShardStore
from astraflow.store.writer import RowBatch, StoreOptions
from tests.conftest import make_run, trained_run_dir

EPISODES = [("Anna has 12 pencils. How many? ", "\\boxed{7}", 1.0), ("She gives 5 to Tom. ", "\\boxed{5}", 0.0)]


def run_with_text(tmp_path):
    """A run whose model directory (char tokenizer) encoded the stored tokens."""
    run = make_run(tmp_path)
    tok = load_hf_tokenizer(make_model("qwen2.5", "tiny", run.path / "model", tokenizer="char",
                                       corpus=[p + c for p, c, _ in EPISODES] * 10))
    prompts = [tok.encode(p, add_special_tokens=False) for p, _, _ in EPISODES]
    answers = [tok.encode(c, add_special_tokens=False) for _, c, _ in EPISODES]
    tokens = np.concatenate([p + a for p, a in zip(prompts, answers)]).astype(np.int32)
    mask = np.concatenate([[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)]).astype(np.uint8)
    n = len(EPISODES)
    rows = {"sample_id": np.arange(n), "task_id": np.arange(n), "episode_id": np.arange(n), "group_id": np.arange(n),
            "policy": np.zeros(n, np.uint8), "worker": np.array([b"w0"] * n, "S64"),
            "length": np.array([len(p) + len(a) for p, a in zip(prompts, answers)], np.int32),
            "reward": np.array([r for _, _, r in EPISODES], np.float32), "guided": np.zeros(n, np.uint8),
            "weight": np.ones(n, np.float32), "gen_s": np.full(n, 0.5, np.float32), "t_commit": np.full(n, 1e9),
            "version_min": np.zeros(n, np.int32), "version_max": np.zeros(n, np.int32),
            "version_at_commit": np.full(n, -1, np.int32)}
    data = {"tokens": tokens, "logprobs": np.zeros(len(tokens), np.float32), "loss_mask": mask,
            "versions": np.where(mask == 1, 0, -1).astype(np.int32), "token_policy": (mask.astype(np.int8) - 1)}
    store = ShardStore(run.path / "shards", ("policy",), StoreOptions())
    store.append(RowBatch(data, rows, [json.dumps({"answer": c}).encode() for _, c, _ in EPISODES]))
    store.close()
    return run.path


def test_export_text_reads_back_with_pandas_alone(tmp_path, capsys):
    run = run_with_text(tmp_path)
    assert main(["export", str(run), "--format", "parquet", "--text"]) == 0
    out = run / "trajectories.parquet"
    assert capsys.readouterr().out.strip() == str(out)
    df = pd.read_parquet(out)
    assert df["prompt"].tolist() == [p for p, _, _ in EPISODES]
    assert df["completion"].tolist() == [c for _, c, _ in EPISODES]
    assert df["reward"].tolist() == [1.0, 0.0] and df["policy"].tolist() == ["policy"] * 2
    assert json.loads(df["meta"][1]) == {"answer": "\\boxed{5}"}
    assert df["completion_tokens"].tolist() == [len(c) for _, c, _ in EPISODES]


def test_export_jsonl_without_text_has_the_token_ids(tmp_path):
    run = trained_run_dir(tmp_path)
    out = tmp_path / "t.jsonl"
    assert main(["export", str(run), "--format", "jsonl", "-o", str(out)]) == 0
    df = pd.read_json(out, lines=True)
    rows = load_rows(run)
    assert len(df) == len(rows) == 32 and "prompt" not in df
    assert df["sample_id"].tolist() == rows["sample_id"].tolist()
    first = load_trajectory(run, rows["shard"][0], 0)
    assert df["prompt_ids"][0] + df["completion_ids"][0] == first["tokens"].tolist()
    assert not (tmp_path / "t.jsonl.tmp").exists()


def test_the_bulk_reader_matches_the_per_row_reader(tmp_path):
    run = trained_run_dir(tmp_path)
    for t in iter_trajectories(run):
        one = load_trajectory(run, t["shard"], t["row"])
        assert t["meta"] == one["meta"] and t["policy"] == one["policy"] and t["worker"] == one["worker"]
        for c in ("tokens", "logprobs", "loss_mask", "versions", "token_policy"):
            np.testing.assert_array_equal(t[c], one[c])


def test_an_unknown_format_is_refused_by_the_cli(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path), "--format", "csv"])
    assert "invalid choice: 'csv'" in capsys.readouterr().err
