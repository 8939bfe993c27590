"""A mistyped run directory is an error naming the path, never an empty report: `audit`,
`inspect`, `plot` and `load_rows`; `plot` without `-o` writes into the run directory."""
from __future__ import annotations

import pytest

from astraflow.cli.main import main
from astraflow.config.rundir import NoRunDir
from astraflow.store.reader import load_rows
from tests.conftest import trained_run_dir


@pytest.mark.parametrize("command", ["audit", "inspect", "plot", "answers"])
def test_a_missing_run_directory_is_a_one_line_error_and_a_failure(tmp_path, capsys, command):
    missing = tmp_path / "no" / "such-run"
    assert main([command, str(missing)]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and str(missing) in err and "no such directory" in err


def test_a_directory_that_is_no_run_is_named_as_such(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) != 0
    assert f"{tmp_path}: not a run directory (no shards in it)" in capsys.readouterr().err


def test_load_rows_of_a_missing_run_raises_instead_of_returning_nothing(tmp_path):
    with pytest.raises(NoRunDir, match="no such directory"):
        load_rows(tmp_path / "nonexistent")
    with pytest.raises(FileNotFoundError):  # what a caller outside the project would catch
        load_rows(tmp_path / "nonexistent", closed_only=True)


def test_plot_without_out_writes_into_the_run_directory(tmp_path, monkeypatch, capsys):
    run = trained_run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(run)]) == 0
    assert (run / "curve.png").stat().st_size > 0 and not (tmp_path / "curve.png").exists()
    assert capsys.readouterr().out.strip() == str(run / "curve.png")
