"""CLI conventions: `--version`; every option explained in `--help`; `astraflow-launch --help`
shows the default subcommand's flags; a run directory is taken as RUN_DIR or --run-dir RUN_DIR
by every command that works on a run; `-v` turns on AstraFlow's debug logging, not every
library's (h5py wrote a line per type conversion)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from astraflow.cli import launch
from astraflow.cli.args import resolve_run_dir
from astraflow.cli.main import build_parser, main
from tests.conftest import REPO, trained_run_dir


def cli(*args: str, module: str = "astraflow.cli.main") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_version():
    for module, prog in (("astraflow.cli.main", "astraflow"), ("astraflow.cli.launch", "astraflow-launch")):
        out = cli("--version", module=module)
        assert out.returncode == 0 and out.stdout.startswith(f"{prog} ") and out.stdout.strip() != prog


def test_launch_help_shows_the_submit_flags():
    out = cli("--help", module="astraflow.cli.launch")
    assert out.returncode == 0
    assert all(flag in out.stdout for flag in ("--partitions", "--site", "--dry-run", "--detach", "--set"))


def undocumented(parser: argparse.ArgumentParser, name: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                missing += undocumented(p, f"{name} {sub}")
        elif not action.help and not isinstance(action, argparse._HelpAction):
            missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_has_help():
    assert undocumented(build_parser(), "astraflow") + undocumented(launch.build_parser(), "astraflow-launch") == []


def test_the_run_directory_is_positional_or_an_option(tmp_path, capsys):
    run = str(trained_run_dir(tmp_path))
    assert main(["inspect", "--json", run]) == 0
    positional = capsys.readouterr().out
    assert main(["inspect", "--json", "--run-dir", run]) == 0
    assert capsys.readouterr().out == positional
    with pytest.raises(SystemExit):
        main(["audit", run, "--run-dir", str(tmp_path)])
    assert "two run directories given" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["audit"])
    assert "the run directory is required: RUN_DIR or --run-dir RUN_DIR" in capsys.readouterr().err
    assert build_parser().parse_args(["prepare", run]).run_dir == run  # components' commands too
    args = launch.build_parser().parse_args(["status", "--run-dir", run])
    resolve_run_dir(args)
    assert args.run_dir == run


def test_verbose_is_astraflow_debug_not_h5py(tmp_path):
    run = trained_run_dir(tmp_path)
    out = cli("-v", "inspect", str(run))
    assert out.returncode == 0, out.stderr
    assert "DEBUG h5py" not in out.stderr


def test_run_takes_an_existing_run_directory_as_its_positional(tmp_path, capsys):
    run = trained_run_dir(tmp_path)
    assert main(["run", str(run), "--run-dir", str(tmp_path / "other")]) == 2
    assert "two run directories given" in capsys.readouterr().err
