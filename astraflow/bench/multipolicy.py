"""`astraflow bench multipolicy`: co-training time per iteration, async against sync schedule.

The same workload runs twice on this machine, `schedule.mode=async` (the default: policies
advance independently, generation overlaps training, bounded by `max_staleness`) and
`schedule.mode=sync` (generate one batch per policy with the latest weights, then train, then
push weights), with the same components — the same worker and engine code, the same in-place
weight reload, the same episode concurrency, the same trainer code. Only the schedule differs.

The workload carries what makes agentic RL slow (fixed below and echoed in the JSON): each
generation decodes a long-tailed number of tokens (lognormal, p99/median 8, capped by
`engine.max_tokens`), and each answer makes an environment round-trip whose server-side
latency is lognormal (median 0.2 s, p99 2 s). A second pair of runs sets that latency to 0.

s/iter: from the first completed update to the last, divided by the updates in between,
the slowest policy counting (start-up — engines, model build, warm-up — is excluded from
both timings). Each mode is a separate run (its own dataflow rank, trainers, run directory
and summary), served by the same engine processes: `rollout.workers` standby workers
(`astraflow rollout --standby`), started once before the first run, join each run in turn
and load its starting weights in place. The JSON names their pids and, per run, the pids
that registered with its dataflow rank.

With `--seeds`, each seed (`run.seed`: warm-up, sampling, trainer initialisation) runs its
own pairs on the same engine processes; the top-level timings, final training rewards and
held-out scores are medians over seeds, and `runs` holds every seed's details. One pair of
runs does not settle "equal rewards": after 30 updates the solver's held-out accuracy
spread by 0.09-0.135 between three seeds of one mode, and the modes differed by at most
0.07 within a seed.
"""
from __future__ import annotations

import statistics
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from astraflow.analysis.metrics import read_metrics
from astraflow.config.loader import load_config
from astraflow.launch.components import cli
from astraflow.launch.local import run_local
from astraflow.launch.supervisor import die_with_parent
from astraflow.store.journal import replay

WORKLOAD = {
    "workflow.env_check": "true",
    "workflow.decode_len_median": "4",
    "workflow.decode_len_p99_ratio": "8",
    "engine.max_tokens": "40",
    "workflow.env_latency_median_s": "0.2",
    "workflow.env_latency_p99_s": "2.0",
    "policies.0.max_staleness": "2",
    "policies.1.max_staleness": "2",
    "rollout.weight_poll_s": "0.05",
    # tasks in flight per worker, in both modes: async hides the environment's latency behind
    # other episodes (16: 2.38 s/iter, 32: 1.34, median of three seeds); a sync round leases
    # only what its batches lack, so it is the same at either (6.14 and 6.20 s/iter)
    "rollout.concurrency": "32",
    # the verifier of the measured comparisons (docs/benchmarks.md): the config's larger
    # batch, learning rate, KL term and contrast answers serve its 600-step learning run
    "policies.1.batch_size": "128",
    "policies.1.lr": "0.00025",
    "policies.1.ref_kl": "0",
    "workflow.verifier_contrast": "false",
}
TIMINGS = ("async_s_per_iter", "sync_s_per_iter", "speedup")
DROP_CAUSES = ("dropped_stale", "filtered_zero_advantage", "unused_trainer_done")  # summing to "dropped"


def seconds_per_iter(run_dir: Path, policies: list[str]) -> float:
    worst = 0.0
    for p in policies:
        rows = read_metrics(run_dir, p)
        if len(rows) < 2:
            raise RuntimeError(f"bench multipolicy: policy {p} made {len(rows)} updates in {run_dir}")
        worst = max(worst, (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1))
    return worst


def registered_pids(run_dir: Path) -> list[int]:
    """The processes that served a run as rollout workers, from its journal."""
    return sorted({e["pid"] for e in replay(run_dir / "journal") if e.get("ev") == "register"})


def one_mode(config: str, mode: str, overrides: list[str], root: Path) -> dict:
    run_dir = root / f"{mode}"
    summary = run_local(config, str(run_dir), [*overrides, f"schedule.mode={mode}"], quiet=True)
    policies = list(summary["policies"])
    return {"s_per_iter": seconds_per_iter(run_dir, policies),
            "rewards": {p: {"first": s.get("reward_first"), "last": s.get("reward_last")}
                        for p, s in summary["policies"].items()},
            "eval": summary.get("eval", {}), "wall_s": summary["wall_s"], "generated": summary["generated"],
            "trained": summary["trained"], "dropped": summary["dropped"],
            "dropped_by_cause": {k: summary[k] for k in DROP_CAUSES}, "worker_pids": registered_pids(run_dir)}


def compare(config: str, overrides: list[str], root: Path) -> dict:
    a = one_mode(config, "async", overrides, root)
    s = one_mode(config, "sync", overrides, root)
    return {"async_s_per_iter": a["s_per_iter"], "sync_s_per_iter": s["s_per_iter"],
            "speedup": s["s_per_iter"] / a["s_per_iter"], "async": a, "sync": s}


def timings(pair: dict) -> dict:
    return {k: pair[k] for k in TIMINGS}


def medians(runs: list[dict]) -> dict:
    """Over seeds: each timing's median (the speedup's is the median of the per-seed
    speedups), and per mode and policy the median final training reward and held-out score."""
    def median(value: Callable[[dict], float]) -> float:
        return statistics.median(value(r) for r in runs)

    def last_per_policy(mode: str, key: str) -> dict:
        return {p: median(lambda r: r[mode][key][p]["last"]) for p in runs[0][mode][key]}

    out: dict = {k: median(lambda r: r[k]) for k in TIMINGS}
    for mode in ("async", "sync"):
        out[mode] = {"reward_last": last_per_policy(mode, "rewards"), "eval_last": last_per_policy(mode, "eval")}
    if "zero_latency" in runs[0]:
        out["zero_latency"] = {k: median(lambda r: r["zero_latency"][k]) for k in TIMINGS}
    return out


@contextmanager
def standby_workers(directory: Path, n: int) -> Iterator[list[int]]:
    """`n` standby rollout workers waiting in `directory`; stopped (leases handed back) after."""
    directory.mkdir(mode=0o700)
    procs = []
    try:
        for i in range(n):
            with open(directory / f"worker-{i}.log", "w") as log:
                procs.append(subprocess.Popen(cli("rollout", "--standby", str(directory), "--worker-id", f"standby-{i}"),
                                              stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def run_bench(config: str, steps: int, extra: list[str], zero_latency: bool = True, run_dir: str | None = None,
              seeds: tuple[int, ...] = (0,)) -> dict:
    workload = {**WORKLOAD, "trainer.steps": str(steps)}
    overrides = [f"{k}={v}" for k, v in workload.items()] + list(extra)
    n_workers = load_config(config, overrides).rollout.workers
    with tempfile.TemporaryDirectory(prefix="astraflow-bench-mp-", dir=run_dir) as tmp:
        root = Path(tmp)
        with standby_workers(root / "standby", n_workers) as pids:
            # the runs start no workers of their own: the standby workers serve them all
            overrides += ["rollout.workers=0", f"rollout.standby={root / 'standby'}"]
            runs = []
            for seed in seeds:
                seeded, where = [*overrides, f"run.seed={seed}"], root / f"seed-{seed}"
                run = {"seed": seed, **compare(config, seeded, where / "latency")}
                if zero_latency:
                    run["zero_latency"] = timings(compare(config, [*seeded, "workflow.env_latency_median_s=0"],
                                                          where / "zero-latency"))
                runs.append(run)
    return {"config": config, "workload": workload, "extra_overrides": list(extra), "seeds": list(seeds),
            "engine_processes": pids, **medians(runs), "runs": runs}
