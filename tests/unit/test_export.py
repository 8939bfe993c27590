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
from astraflow.store.reader import iter_trajectories, load_rows, load_trajectory
from tests.conftest import EPISODES, text_run_dir, trained_run_dir

def test_export_text_reads_back_with_pandas_alone(tmp_path, capsys):
    run = text_run_dir(tmp_path)
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
