"""`astraflow` — the one entry point. Subcommands are declared one by one in `build_parser`.

Imports of components happen inside each command, so `astraflow --help` and `astraflow
inspect` stay fast and never load torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Callable

from astraflow.config.loader import ConfigError


def _dataflow(args: argparse.Namespace) -> int:
    from astraflow.config.rundir import RunDir
    from astraflow.dataflow.server import DataflowServer

    run = RunDir.create_or_open(args.run_dir, args.config, args.set)
    DataflowServer(run, local=True if args.local else None).serve()
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from astraflow.analysis.inspect import format_report, inspect_run

    report = inspect_run(args.run_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from astraflow.bench.dataflow import run_bench

    result = run_bench(workers=args.workers, clients_per_process=args.clients_per_process,
                       seconds=args.seconds, tokens=args.tokens, compression=args.compression,
                       run_dir=args.run_dir)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="the run directory (created if absent)")
    p.add_argument("--config", help="YAML config (needed only to create a new run directory)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (on an existing run: runtime-changeable keys only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astraflow", description="Dataflow-oriented RL for agentic LLMs.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dataflow", help="run the dataflow rank (tasks, leases, buffers, HDF5 store)")
    _add_run_args(p)
    p.add_argument("--local", action="store_true", help="treat as a local run even under Slurm (bind loopback)")
    p.set_defaults(fn=_dataflow)

    p = sub.add_parser("inspect", help="summarise a run's HDF5 trajectory shards (works on a live run)")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_inspect)

    p = sub.add_parser("bench", help="benchmarks (print JSON)")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("dataflow", help="commit/serve throughput of the dataflow rank over the real protocol")
    b.add_argument("--workers", type=int, default=8)
    b.add_argument("--clients-per-process", type=int, default=8)
    b.add_argument("--seconds", type=float, default=20.0)
    b.add_argument("--tokens", type=int, default=1024)
    b.add_argument("--compression", choices=("none", "lzf", "gzip"), default="none")
    b.add_argument("--run-dir", help="keep the run here (default: a temporary directory)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench)
    return parser




def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"astraflow: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
