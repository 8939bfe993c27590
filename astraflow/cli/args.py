"""Argument conventions shared by `astraflow` and `astraflow-launch`.

The run directory: every command that works on a run takes it either way, as the positional
`RUN_DIR` or as `--run-dir RUN_DIR` (components are started with the option; people type the
positional). `add_run_dir` declares both, `resolve_run_dir` (after parsing) picks the one
given and refuses neither or two different ones with the subcommand's usage.
"""
from __future__ import annotations

import argparse
from importlib import metadata

RUN_DIR_HELP = "the run directory (as RUN_DIR or --run-dir RUN_DIR)"


def version() -> str:
    try:
        return metadata.version("astraflow")
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")


def add_run_dir(p: argparse.ArgumentParser, help: str = RUN_DIR_HELP, required: bool = True) -> None:
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help=help)
    p.add_argument("--run-dir", dest="run_dir_option", metavar="RUN_DIR", help="the same as RUN_DIR")
    p.set_defaults(run_dir_parser=p, run_dir_required=required)


def resolve_run_dir(args: argparse.Namespace) -> None:
    """Set `args.run_dir` from the positional or the option (see the module docstring)."""
    parser = getattr(args, "run_dir_parser", None)
    if parser is None:
        return
    given = [d for d in (args.run_dir, args.run_dir_option) if d]
    if len(set(given)) > 1:
        parser.error(f"two run directories given: {given[0]} and --run-dir {given[1]}; give one")
    if not given and args.run_dir_required:
        parser.error("the run directory is required: RUN_DIR or --run-dir RUN_DIR")
    args.run_dir = given[0] if given else None
