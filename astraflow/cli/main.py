"""`astraflow` — the one entry point. Subcommands are declared one by one in `build_parser`.

Imports of components happen inside each command, so `astraflow --help` and `astraflow
inspect` stay fast and never load torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from astraflow.cli.args import add_run_dir, add_version, resolve_run_dir
from astraflow.config.loader import ConfigError
from astraflow.config.rundir import NoRunDir
from astraflow.config.schema import RELAYS, WeightsConfig


def _dataflow(args: argparse.Namespace) -> int:
    from astraflow.config.rundir import RunDir
    from astraflow.dataflow.server import DataflowServer
    from astraflow.store.errors import StoreStop

    run = RunDir.create_or_open(args.run_dir, args.config, args.set)
    try:
        DataflowServer(run, local=True if args.local else None).serve()
    except StoreStop as e:
        print(f"astraflow dataflow: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from astraflow.analysis.inspect import format_report, inspect_run

    report = inspect_run(args.run_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _answers(args: argparse.Namespace) -> int:
    from astraflow.analysis.answers import answers_report, format_answers

    report = answers_report(args.run_dir, args.buckets, args.top)
    print(json.dumps(report, indent=2) if args.json else format_answers(report))
    return 0


def _audit(args: argparse.Namespace) -> int:
    from astraflow.analysis.audit import audit, format_audit

    report = audit(args.run_dir)
    print(json.dumps(report, indent=2) if args.json else format_audit(report))
    return 0 if report["ok"] else 1


def _bench(args: argparse.Namespace) -> int:
    from astraflow.bench.dataflow import run_bench

    result = run_bench(workers=args.workers, clients_per_process=args.clients_per_process,
                       seconds=args.seconds, tokens=args.tokens, compression=args.compression,
                       fsync=args.fsync, run_dir=args.run_dir)
    print(json.dumps(result, indent=None if args.json else 2))
    for problem in result["problems"]:
        print(f"astraflow bench dataflow: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0


def _make_model(args: argparse.Namespace) -> int:
    from astraflow.models.factory import make_model

    print(make_model(args.like, args.size, args.out_dir, seed=args.seed, tokenizer=args.tokenizer, tied=args.tied))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """Build the run's model once, then each policy's starting point: the model warmed up for
    the policy's role. A no-op for what exists already."""
    import shutil

    from astraflow.config.rundir import RunDir
    from astraflow.heap import long_lived
    from astraflow.models import base_model_dir, policy_model_dir
    from astraflow.models.directory import check_model_dir
    from astraflow.tasks.sources import TaskSource

    with long_lived():  # torch and transformers
        from astraflow.models.factory import make_model
        from astraflow.trainer.warmup import warm_up

    run = RunDir.open(args.run_dir)
    cfg = run.config
    base = base_model_dir(run.path, cfg.model.path)
    if cfg.model.path:  # a configured model is used as it is: never built in place of a missing one
        check_model_dir(base)
    elif not (base / "config.json").exists():
        m = cfg.model
        tmp = run.path / "model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_model(m.like, m.size, tmp, seed=m.seed, corpus=TaskSource(cfg.tasks).corpus(), tokenizer=m.tokenizer,
                   tied=m.tied)
        tmp.rename(base)
    for policy in cfg.policies:
        target = policy_model_dir(run.path, cfg, policy.name)
        if target == base or (target / "config.json").exists():
            continue
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)
        warm_up(tmp, cfg, policy.role)
        tmp.rename(target)
    return 0


def _exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's teardown, which takes about 4 s in a process that hosted
    a vLLM engine on CPU (measured: engine closed, then exit) and 1 s in one that imported the
    trainer's modules; a worker (standby or not) that has left its pool, a finished evaluation
    or a trainer that has closed its metrics, checkpoint and client has nothing left to write
    but its buffered output."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rollout(args: argparse.Namespace) -> int:
    if args.standby:
        from astraflow.rollout.standby import run_standby
        from astraflow.slurm.env import rollout_worker_id

        run_standby(args.standby, args.policies, args.worker_id or rollout_worker_id())
    else:
        from astraflow.rollout.worker import run_worker

        run_worker(args.run_dir, args.policies, args.worker_id)
    _exit_now(0)


def _train(args: argparse.Namespace) -> int:
    from astraflow.heap import long_lived
    from astraflow.launch.supervisor import EXIT_STOPPED

    with long_lived():  # torch and transformers
        from astraflow.trainer.loop import run_trainer

    _exit_now(0 if run_trainer(args.run_dir, args.policy) else EXIT_STOPPED)


def _eval(args: argparse.Namespace) -> int:
    from astraflow.analysis.sinks import record_eval
    from astraflow.config.rundir import RunDir
    from astraflow.rollout.evaluate import evaluate_run

    if args.after_stdin:
        os.nice(19)  # it imports beside a starting job: it must not slow the components
    run = RunDir.open(args.run_dir)
    out = evaluate_run(run, sys.stdin.read if args.after_stdin else lambda: None)
    (Path(args.run_dir) / "eval.json").write_text(json.dumps(out, indent=2))  # engines may print to stdout
    record_eval(run.path, out, run.config)
    print(json.dumps(out))
    _exit_now(0)


def _run(args: argparse.Namespace) -> int:
    from astraflow.launch.local import run_local
    from astraflow.launch.summary import format_summary

    config, run_dir = args.config, args.run_dir
    if config and Path(config).is_dir():  # `astraflow run RUN_DIR`: resume it
        if run_dir and Path(run_dir) != Path(config):
            raise ConfigError(f"two run directories given: {config} and --run-dir {run_dir}; give one")
        config, run_dir = None, config
    summary = run_local(config, run_dir, args.set, quiet=args.quiet)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from astraflow.analysis.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _export(args: argparse.Namespace) -> int:
    from astraflow.analysis.export import export_run

    print(export_run(args.run_dir, args.format, args.out, text=args.text))
    return 0


def _report(args: argparse.Namespace) -> int:
    from astraflow.analysis.report import write_report

    print(write_report(args.run_dir, args.out))
    return 0


def _bench_elastic(args: argparse.Namespace) -> int:
    from astraflow.bench.elastic import run_bench

    result = run_bench(args.config, args.partitions.split(","), args.array_partition, args.engine, args.repeats)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench_rollout(args: argparse.Namespace) -> int:
    if args.workload == "long-tail":
        from astraflow.bench.longtail import run_longtail

        result = run_longtail(args.clients, args.requests, args.median_tokens, args.cap_tokens, args.rounds)
    else:
        from astraflow.bench.rollout import run_bench

        result = run_bench(args.engines, args.sizes, args.max_tokens)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench_fuzz(args: argparse.Namespace) -> int:
    from astraflow.bench.fuzz import run_bench

    result = run_bench(args.seconds, args.max_messages, args.fuzzers, args.seed, args.flooders, args.max_message_mb)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if not result["correct_client"]["n_failures"] else 1  # a dead rank raised already


def _bench_multipolicy(args: argparse.Namespace) -> int:
    from astraflow.bench.multipolicy import run_bench

    result = run_bench(args.config, args.steps, args.set, zero_latency=not args.no_zero_latency, seeds=tuple(args.seeds))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench_staleness(args: argparse.Namespace) -> int:
    from astraflow.bench.staleness import run_bench

    result = run_bench(args.config, args.seeds, args.target, args.set)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench_learn(args: argparse.Namespace) -> int:
    from astraflow.bench.learn import run_bench

    result = run_bench(args.config, args.seeds, args.set, args.first_at_most, args.last_at_least, args.heldout_gain,
                       args.wall_s, keep=args.keep)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if result["passed"] else 1


def _bench_weights(args: argparse.Namespace) -> int:
    from astraflow.bench.weights import run_bench

    result = run_bench(args.like, args.size, args.lr, args.versions, args.dtype, args.threads, args.workers,
                       args.rounds, args.bucket_mb, args.relay)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench_restart(args: argparse.Namespace) -> int:
    from astraflow.bench.restart import run_bench

    result = run_bench(args.stored, args.consumed_fraction, args.tokens, shard_mb=args.shard_mb, compact=args.compact)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if result["recovered_all"] and result["from_compact_state"] == args.compact else 1


def _bench_scale(args: argparse.Namespace) -> int:
    from astraflow.bench.scale import run_bench

    result = run_bench(clients=args.clients, stored=args.stored, seconds=args.seconds, processes=args.processes,
                       tokens=args.tokens, gen_s=args.gen_s, concurrency=args.concurrency)
    print(json.dumps(result, indent=None if args.json else 2))
    for problem in result["problems"]:
        print(f"astraflow bench scale: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0


def _env_server(args: argparse.Namespace) -> int:
    from astraflow.environments.server import main as serve

    return serve(args)


def _node(args: argparse.Namespace) -> int:
    from astraflow.slurm.node import run_node

    return run_node(args.config, args.run_dir, args.set)


def _status(args: argparse.Namespace) -> int:
    from astraflow.slurm.status import print_status

    return print_status(args.run_dir, args.json)


def env_server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed on the first stdout line)")
    p.add_argument("--max-turns", type=int, default=3, help="steps of an episode before it ends (default: %(default)s)")
    p.add_argument("--latency-median-s", type=float, default=0.0, help="per step, lognormal")
    p.add_argument("--latency-p99-s", type=float, default=2.0,
                   help="99th percentile of the per-step latency, lognormal (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the latencies and the environments' tasks")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    add_run_dir(p, "the run directory, created if absent (as RUN_DIR or --run-dir RUN_DIR)")
    p.add_argument("--config", help="YAML config: creates a new run directory; with an existing one it must be "
                                     "that run's config (else refused: resume without it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


JSON_HELP = "print the report as JSON"
SET_HELP = ("override a config key, repeatable (e.g. trainer.steps=30; policies.NAME.KEY=VALUE); on an existing "
            "run only runtime-changeable keys (docs/configuration.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astraflow", description="Dataflow-oriented RL for agentic LLMs.")
    add_version(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging of AstraFlow's own modules")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("dataflow", help="run the dataflow rank (tasks, leases, buffers, HDF5 store)")
    _add_run_args(p)
    p.add_argument("--local", action="store_true", help="treat as a local run even under Slurm (bind loopback)")
    p.set_defaults(fn=_dataflow)

    p = sub.add_parser("run", help="run every component locally, supervised (the embedded default)")
    p.add_argument("config", nargs="?", metavar="CONFIG|RUN_DIR",
                   help="a YAML config (a path, or the name of a packaged one: quickstart, math_chat, code, "
                        "search, multi_policy, cotrain_chat) for a new run; or an existing run directory to resume "
                        "it. With an existing --run-dir a config that differs from the run's is refused, naming the "
                        "keys (runtime keys change with --set)")
    p.add_argument("--run-dir", help="run directory (default: runs/<config>-<time>; existing: resume)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress output (on a terminal a line redrawn every "
                                                        "second, otherwise a line every 10 s)")
    p.add_argument("--json", action="store_true", help="end with RUN_DIR/summary.json as one line of JSON instead of "
                                                       "a short summary")
    p.set_defaults(fn=_run)

    p = sub.add_parser("rollout", help="run a rollout worker")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", help="the run to serve")
    where.add_argument("--standby", metavar="DIR",
                       help="wait in DIR for runs that announce themselves there (rollout.standby) and serve "
                            "them one after another, keeping the engines")
    p.add_argument("--policies", nargs="*", default=[], help="policies to host (default: all)")
    p.add_argument("--worker-id", help="stable base id (default: from Slurm, else host-pid)")
    p.set_defaults(fn=_rollout)

    p = sub.add_parser("train", help="run the trainer of one policy")
    add_run_dir(p)
    p.add_argument("--policy", required=True, help="the policy (a name under policies in the config) to train")
    p.set_defaults(fn=_train)

    p = sub.add_parser("node", help="one task of the heterogeneous Slurm step (started by srun in the job script)")
    _add_run_args(p)
    p.set_defaults(fn=_node)

    p = sub.add_parser("status", help="a run's Slurm jobs, workers and throughput per partition")
    add_run_dir(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_status)

    p = sub.add_parser("make-model", help="write a random-init HF model directory of a family, with a tokenizer "
                                          "trained locally (no downloads)")
    p.add_argument("out_dir", help="the directory to write (created)")
    p.add_argument("--like", default="qwen2.5", choices=("qwen2.5", "llama3", "qwen2", "llama"),
                   help="the family whose config fields, special tokens and chat template to use")
    p.add_argument("--size", default="tiny", help="tiny, small; the real shapes 0.5b, 1.5b (qwen2.5), 1b (llama3)")
    p.add_argument("--tokenizer", default="", choices=("", "bpe", "char"), help="default: the family's")
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="tie input and output embeddings (default: as the family at that size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    p.set_defaults(fn=_make_model)

    p = sub.add_parser("prepare", help="build and warm up a run's model (astraflow run does this)")
    add_run_dir(p)
    p.set_defaults(fn=_prepare)

    p = sub.add_parser("eval", help="greedy held-out accuracy of the base and last published weights (eval.json)")
    add_run_dir(p)
    p.add_argument("--after-stdin", action="store_true",
                   help="import the engine at once, score once stdin closes (the launcher's signal)")
    p.set_defaults(fn=_eval)

    p = sub.add_parser("env-server", help="serve the built-in text environment over HTTP (agentic workflows)")
    env_server_arguments(p)
    p.set_defaults(fn=_env_server)

    p = sub.add_parser("inspect", help="summarise a run's HDF5 trajectory shards (works on a live run)")
    add_run_dir(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_inspect)

    p = sub.add_parser("answers", help="mean reward per reference answer over versions, from a run's shards")
    add_run_dir(p)
    p.add_argument("--buckets", type=int, default=5, help="version ranges (default 5)")
    p.add_argument("--top", type=int, default=40, help="show the N answers with most samples (default 40)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_answers)

    p = sub.add_parser("audit", help="check a run's exactly-once promises from its shards and journal (exit 1 if not)")
    add_run_dir(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_audit)

    p = sub.add_parser("plot", help="plot a run's training curve (PNG) from its metrics")
    add_run_dir(p)
    p.add_argument("-o", "--out", help="the PNG to write (default: RUN_DIR/curve.png, inside the run directory)")
    p.set_defaults(fn=_plot)

    p = sub.add_parser("export", help="a run's trajectories as one Parquet or JSONL file (pandas, DuckDB, datasets)")
    add_run_dir(p)
    p.add_argument("--format", choices=("parquet", "jsonl"), default="parquet", help="default: %(default)s")
    p.add_argument("--text", action="store_true", help="add the prompt and completion decoded by the run's tokenizer")
    p.add_argument("-o", "--out", help="the file to write (default: RUN_DIR/trajectories.FORMAT)")
    p.set_defaults(fn=_export)

    p = sub.add_parser("report", help="one self-contained HTML page of a run: curves, counts, lag, workers, samples")
    add_run_dir(p)
    p.add_argument("-o", "--out", help="the HTML file to write (default: RUN_DIR/report.html)")
    p.set_defaults(fn=_report)

    p = sub.add_parser("bench", help="benchmarks (print JSON)")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("dataflow", help="commit/serve throughput of the dataflow rank over the real protocol")
    b.add_argument("--workers", type=int, default=8, help="worker processes committing (default: %(default)s)")
    b.add_argument("--clients-per-process", type=int, default=8,
                   help="concurrent clients in each worker process (default: %(default)s)")
    b.add_argument("--seconds", type=float, default=20.0, help="measured seconds (default: %(default)s)")
    b.add_argument("--tokens", type=int, default=1024, help="tokens per trajectory (default: %(default)s)")
    b.add_argument("--compression", choices=("none", "lzf", "gzip"), default="none",
                   help="shard compression (default: %(default)s)")
    b.add_argument("--fsync", choices=("true", "false"), default="true",
                   help="store.fsync: fsync the shard and the journal at every flush (default: %(default)s)")
    b.add_argument("--run-dir", help="keep the run here (default: a temporary directory)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench)
    b = bsub.add_parser("rollout", help="tokens/s of the vllm and hf engines on the same tiny and small models")
    b.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=("hf", "vllm", "vllm-batch"),
                   help="engines to measure (default: both)")
    b.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=("tiny", "small"),
                   help="model sizes to measure (default: both)")
    b.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default: %(default)s)")
    b.add_argument("--workload", choices=("throughput", "long-tail"), default="throughput",
                   help="throughput: the engines and sizes above; long-tail: the vllm engine, continuous against "
                        "batch-synchronous, on lognormal output lengths (bench/longtail.py) (default: %(default)s)")
    b.add_argument("--clients", type=int, default=32, help="long-tail: episodes at a time (default: %(default)s)")
    b.add_argument("--requests", type=int, default=256, help="long-tail: requests per round (default: %(default)s)")
    b.add_argument("--median-tokens", type=int, default=16,
                   help="long-tail: median output length (default: %(default)s)")
    b.add_argument("--cap-tokens", type=int, default=400, help="long-tail: longest output (default: %(default)s)")
    b.add_argument("--rounds", type=int, default=3, help="long-tail: measured rounds (default: %(default)s)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_rollout)

    b = bsub.add_parser("elastic", help="seconds for a rollout array to join a running Slurm job")
    b.add_argument("--config", default="configs/quickstart.yaml", help="run config (default: %(default)s)")
    b.add_argument("--partitions", default="gpu-h100,gpu-a100", help="the job's TRAINER,ROLLOUT[,DATAFLOW]")
    b.add_argument("--array-partition", default="gpu-h100", help="where the added workers go")
    b.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                   help="the rollout engine of the added workers (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=3, help="joins measured (default: %(default)s)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_elastic)

    b = bsub.add_parser("fuzz", help="hostile messages against a live dataflow rank while a correct client works")
    b.add_argument("--seconds", type=float, default=60.0, help="seconds to fuzz (default: %(default)s)")
    b.add_argument("--max-messages", type=int, default=10**9, help="stop after this many hostile messages")
    b.add_argument("--fuzzers", type=int, default=2, help="fuzzer processes (half of them hold the run secret)")
    b.add_argument("--flooders", type=int, default=0,
                   help="processes sending only frames just under the size limit, wrongly signed")
    b.add_argument("--max-message-mb", type=float, default=1.0, help="the rank's dataflow.max_message_mb")
    b.add_argument("--seed", type=int, help="seed of the fuzzers (default: random, printed)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_fuzz)

    b = bsub.add_parser("multipolicy", help="seconds per iteration of co-training, async against sync schedule")
    b.add_argument("--config", default="configs/multi_policy.yaml", help="run config (default: %(default)s)")
    b.add_argument("--steps", type=int, default=20, help="updates per policy in each mode")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides for both modes")
    b.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed of each pair of runs (medians reported)")
    b.add_argument("--no-zero-latency", action="store_true", help="skip the pair of runs with env latency 0")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_multipolicy)

    b = bsub.add_parser("staleness", help="samples-to-target at the config's max_staleness against 0, over seeds")
    b.add_argument("--config", default="configs/quickstart.yaml", help="run config (default: %(default)s)")
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="run.seed of each run (default: %(default)s)")
    b.add_argument("--target", type=float, default=0.8, help="moving-average generated reward to reach")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_staleness)

    b = bsub.add_parser("learn", help="run a config over seeds: rewards, held-out scores, wall time (exit 1 if the "
                                      "medians miss the targets)")
    b.add_argument("--config", default="configs/math_chat.yaml", help="run config (default: %(default)s)")
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="run.seed of each run (default: %(default)s)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    b.add_argument("--first-at-most", type=float, default=0.3, help="generated reward over the first 10%% of steps")
    b.add_argument("--last-at-least", type=float, default=0.6, help="generated reward over the last 10%% of steps")
    b.add_argument("--heldout-gain", type=float, default=0.2, help="greedy held-out score, last minus starting weights")
    b.add_argument("--wall-s", type=float, default=600.0, help="seconds per run, everything included")
    b.add_argument("--keep", metavar="DIR", help="run the seeds in DIR/seed-N and keep them (default: removed)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_learn)

    b = bsub.add_parser("weights", help="bytes and seconds of the filesystem weight channel: full versions and "
                                        "sparse deltas after real AdamW steps")
    b.add_argument("--like", default="qwen2.5", help="model family (astraflow/models/families.py)")
    b.add_argument("--size", default="0.5b", help="the family's shape (0.5b: 494 M parameters)")
    b.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5, 1e-3],
                   help="learning rates, each from the same start (1e-3: the quickstart's)")
    b.add_argument("--versions", type=int, default=3, help="delta versions per learning rate (medians over them)")
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the publish dtype (the training dtype)")
    b.add_argument("--threads", type=int, default=2, help="torch threads of the trainer side and the worker's engine")
    b.add_argument("--workers", type=int, nargs="*", default=[],
                   help="also the collective channel (gloo) to this many receiver processes each, beside a raw "
                        "broadcast of the same bytes, e.g. --workers 1 4")
    b.add_argument("--rounds", type=int, default=3, help="versions sent per worker count (medians over them)")
    b.add_argument("--bucket-mb", type=float, default=WeightsConfig.bucket_mb,
                   help="the channel's bucket size (weights.bucket_mb)")
    b.add_argument("--relay", default=WeightsConfig.relay, choices=RELAYS,
                   help="how the channel moves the payload (weights.relay)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_weights)

    b = bsub.add_parser("restart", help="a dataflow rank's restart time and memory with N stored trajectories")
    b.add_argument("--stored", type=int, default=1_000_000, help="trajectories in the run's shards")
    b.add_argument("--consumed-fraction", type=float, default=0.9, help="of them, acknowledged by a trainer")
    b.add_argument("--tokens", type=int, default=4, help="tokens per trajectory")
    b.add_argument("--shard-mb", type=float, default=1024.0, help="store.shard_max_mb (smaller: more shards)")
    b.add_argument("--compact", action="store_true", help="write the compact state before the restart (timed)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_restart)

    b = bsub.add_parser("scale", help="the dataflow rank under many simulated workers, over many stored trajectories")
    b.add_argument("--clients", type=int, default=1024, help="simulated rollout workers")
    b.add_argument("--stored", type=int, default=1_000_000, help="trajectories already in the run's shards")
    b.add_argument("--seconds", type=float, default=60.0, help="how long the workers run")
    b.add_argument("--processes", type=int, default=4, help="processes the workers are spread over")
    b.add_argument("--tokens", type=int, default=64, help="tokens per committed trajectory")
    b.add_argument("--gen-s", type=float, default=4.0, help="mean generation time of a task (exponential)")
    b.add_argument("--concurrency", type=int, default=2,
                   help="episodes each simulated worker runs at once (a real worker's rollout.concurrency: 16)")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.set_defaults(fn=_bench_scale)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_run_dir(args)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    if args.verbose:  # AstraFlow's modules only: libraries' debug output (h5py: a line per type conversion) is noise
        logging.getLogger("astraflow").setLevel(logging.DEBUG)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, where a closed pipe can be handled
        return code
    except (ConfigError, NoRunDir) as e:  # already phrased for the user, naming the file or path
        print(f"astraflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `astraflow inspect --json | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 1


if __name__ == "__main__":
    sys.exit(main())
