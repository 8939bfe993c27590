"""`astraflow-launch`: render and submit the heterogeneous Slurm job, grow or shrink it, watch it.

    astraflow-launch [submit] [--config CFG] --partitions TRAINER,ROLLOUT[,DATAFLOW]
                     [--site launchers/SITE.yaml] [--run-dir DIR] [--set K=V] [--dry-run] [--detach]
    astraflow-launch scale RUN_DIR (--add N [--partition P] | --remove N [--partition P])
    astraflow-launch status RUN_DIR [--json]

`submit` is the default subcommand. It creates the run directory first (so a bad config is
rejected before anything is queued, and Slurm can write the job's log into it), renders the
job script into `RUN_DIR/slurm/`, submits it with sbatch (submitit cannot express a
heterogeneous job; it submits the rollout arrays of `scale`), prints the job id and run
directory, then follows the run until it ends unless `--detach`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from astraflow.cli.args import add_run_dir, add_version, resolve_run_dir
from astraflow.config.loader import ConfigError

SUBCOMMANDS = ("submit", "scale", "status")
FOLLOW_POLL_S = 2.0


def _submit(args: argparse.Namespace) -> int:
    from astraflow.config.loader import find_config, load_config
    from astraflow.config.rundir import RunDir
    from astraflow.slurm import jobs
    from astraflow.slurm.render import JobShape, render_hetjob
    from astraflow.slurm.site import load_site, site_path

    args.config = str(find_config(args.config))  # the job script names the file itself
    site = load_site(args.site)
    partitions = [p.strip() for p in args.partitions.split(",")]
    cfg = load_config(args.config, args.set)
    shape = JobShape.of(cfg, site, partitions)
    run_dir = args.run_dir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    python = site.python or sys.executable
    if args.dry_run:
        print(render_hetjob(shape, site, args.config, python, run_dir=run_dir,
                          output=str(Path(run_dir) / "logs" / "slurm-%j.out")))
        return 0
    run = RunDir.create_or_open(run_dir, args.config, args.set)
    if args.site:  # the elastic controller inside the job submits arrays with the same profile
        (run.path / "slurm").mkdir(mode=0o700, exist_ok=True)
        shutil.copyfile(site_path(args.site), run.path / "slurm" / "site.yaml")
    job_id = jobs.submit_hetjob(run, shape, site, python)
    print(f"submitted job {job_id}; run directory {run.path}", flush=True)
    return 0 if args.detach else _follow(run, job_id)


def _follow(run, job_id: str) -> int:
    from astraflow.launch.progress import Progress
    from astraflow.launch.summary import format_summary
    from astraflow.slurm import jobs

    progress = Progress(run, quiet=False)
    try:
        while jobs.squeue([job_id]):
            progress.update()
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        progress.close()
        print(f"\nstopped following; the job runs on (astraflow-launch status {run.path})")
        return 0
    progress.close()
    summary = run.path / "summary.json"
    if not summary.exists():
        print(f"job {job_id} ended without a summary; see {run.path / 'logs'}", file=sys.stderr)
        return 1
    print(format_summary({**json.loads(summary.read_text()), "run_dir": str(run.path)}))
    return 0


def _scale(args: argparse.Namespace) -> int:
    from astraflow.config.rundir import RunDir
    from astraflow.slurm import scale
    from astraflow.slurm.arrays import submit_rollout_array
    from astraflow.slurm.site import load_site

    run = RunDir.open(args.run_dir)
    if args.add:
        site_file = run.path / "slurm" / "site.yaml"
        site = load_site(args.site or (str(site_file) if site_file.exists() else None))
        partition = args.partition or _rollout_partition(run.path)
        array = submit_rollout_array(run, args.add, partition, site, site.python or sys.executable, reason=args.reason)
        print(f"submitted rollout array {array} ({args.add} tasks on {partition})")
    else:
        removed = scale.remove(run, args.remove, args.partition)
        print(f"drained or cancelled {len(removed)} workers: {' '.join(removed)}")
    return 0


def _rollout_partition(run_path: Path) -> str:
    from astraflow.slurm import jobs

    hetjobs = jobs.load(run_path)["hetjobs"]
    if hetjobs:
        return hetjobs[-1]["partitions"][2]
    for record in sorted((run_path / "rendezvous").glob("job-*.json")):
        tasks = json.loads(record.read_text())["tasks"]
        return next(t["partition"] for t in tasks if t["role"] == "rollout")
    raise ConfigError("scale --add: give --partition (this run has no recorded job to take it from)")


def _status(args: argparse.Namespace) -> int:
    from astraflow.slurm.status import print_status

    return print_status(args.run_dir, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astraflow-launch", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="render and submit the heterogeneous job (the default: `astraflow-launch "
                                      "--partitions ...` is `astraflow-launch submit --partitions ...`)")
    p.add_argument("--config", default="configs/quickstart.yaml", help="run config (default: %(default)s)")
    p.add_argument("--partitions", required=True, help="TRAINER,ROLLOUT[,DATAFLOW] partitions")
    p.add_argument("--site", help="site profile: a name in launchers/ or a path (default: local)")
    p.add_argument("--run-dir", help="run directory (default: runs/<config>-<time>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, repeatable")
    p.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    p.add_argument("--detach", action="store_true", help="do not follow the run after submitting")
    p.set_defaults(fn=_submit)
    # `astraflow-launch --help` shows the default subcommand's options too (the README's flags)
    parser.epilog = "submit, the default subcommand:\n" + p.format_help()

    p = sub.add_parser("scale", help="grow or shrink a running job's rollout pool")
    add_run_dir(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--add", type=int, metavar="N", help="submit a rollout array of N tasks")
    what.add_argument("--remove", type=int, metavar="N", help="drain N array workers and cancel their tasks")
    p.add_argument("--partition", help="where to add (default: the job's rollout partition) / whom to remove")
    p.add_argument("--site", help="site profile for the array (default: the run's, else local)")
    p.add_argument("--reason", default="scale --add", help="recorded with the array in RUN_DIR/slurm/jobs.json")
    p.set_defaults(fn=_scale)

    p = sub.add_parser("status", help="the run's Slurm jobs, workers and throughput per partition")
    add_run_dir(p)
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(fn=_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help", "--version"):
        argv.insert(0, "submit")
    args = build_parser().parse_args(argv)
    resolve_run_dir(args)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"astraflow-launch: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # SlurmError and friends: already phrased for the user
        print(f"astraflow-launch: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
