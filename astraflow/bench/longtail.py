"""`astraflow bench rollout --workload long-tail`: continuous batching (the `vllm` engine)
against the batch-synchronous path (`vllm-batch`) on long-tailed generation, in one run.

The workload is the rollout worker's: `clients` episodes at a time, each submitting its next
request when the previous one is answered (a closed loop), `requests` requests in all. Output
lengths are drawn once (seed 0) from a lognormal (median `median`, sigma `SIGMA`: p99/median =
exp(2.326 sigma) = 10.2 in theory; the drawn set's own ratio is reported), cut to `cap`, and
decoded exactly (`ignore_eos`), so both engines do the same work in the same order. Each
engine runs in its own process (engines own global state) on the same freshly built tiny
model: one warm-up round, then `rounds` measured rounds; per round tokens/s (tokens decoded /
wall seconds) and each request's latency (submission to answer), p50 and p99. The summary
takes the median round of each engine and compares them.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIGMA = 1.0
ENGINES = ("vllm-batch", "vllm")  # the baseline first


def lengths(requests: int, median: int, cap: int) -> list[int]:
    """The workload's output lengths: lognormal, the same for every engine."""
    drawn = np.random.default_rng(0).lognormal(np.log(median), SIGMA, requests)
    return np.clip(np.rint(drawn), 1, cap).astype(int).tolist()


def measure(kind: str, clients: int, requests: int, median: int, cap: int, rounds: int) -> dict:
    from astraflow.config.schema import EngineConfig
    from astraflow.models.factory import make_model
    from astraflow.models.tokenizer import ModelTokenizer
    from astraflow.rollout.engines import ENGINES as BUILDERS, import_library
    from astraflow.rollout.engines.base import SamplingParams

    cfg = EngineConfig(kind=kind)
    import_library(cfg)
    model_dir = make_model("qwen2", "tiny", Path(tempfile.mkdtemp()) / "model", corpus=["12+7=19"])
    engine = BUILDERS[kind](str(model_dir), max_batch=cfg.max_batch, seed=0, batch_wait_s=cfg.batch_wait_ms / 1e3)
    tokenizer = ModelTokenizer(model_dir)
    todo = lengths(requests, median, cap)
    prompts = [tokenizer.encode_prompt(f"{i}+{i % 17}=") for i in range(requests)]

    async def one_round() -> dict:
        latencies = [0.0] * requests
        decoded = [0] * requests
        queue = iter(range(requests))

        async def episode() -> None:
            for i in queue:  # a shared iterator: each request is taken by one episode
                t = time.perf_counter()
                out = await engine.generate(prompts[i], SamplingParams(todo[i], 1.0, ignore_eos=True))
                latencies[i], decoded[i] = time.perf_counter() - t, out.decoded

        t0 = time.perf_counter()
        await asyncio.gather(*(episode() for _ in range(clients)))
        wall = time.perf_counter() - t0
        assert decoded == todo, "an engine decoded other lengths than asked"
        return {"tokens_per_s": sum(decoded) / wall, "wall_s": wall,
                "p50_latency_s": float(np.percentile(latencies, 50)),
                "p99_latency_s": float(np.percentile(latencies, 99))}

    async def all_rounds() -> list[dict]:
        await one_round()  # warm-up
        return [await one_round() for _ in range(rounds)]

    runs = asyncio.run(all_rounds())
    engine.close()
    middle = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    return {"engine": kind, **middle, "runs": runs}


def run_longtail(clients: int, requests: int, median: int, cap: int, rounds: int) -> dict:
    todo = lengths(requests, median, cap)
    workload = {"clients": clients, "requests": requests, "tokens": sum(todo), "median_tokens": statistics.median(todo),
                "p99_tokens": float(np.percentile(todo, 99)), "max_tokens": max(todo)}
    workload["p99_over_median"] = workload["p99_tokens"] / workload["median_tokens"]
    results = {}
    for kind in ENGINES:
        out = subprocess.run([sys.executable, "-m", "astraflow.bench.longtail", kind, str(clients), str(requests),
                              str(median), str(cap), str(rounds)], capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        results[kind] = (json.loads(lines[-1]) if out.returncode == 0 and lines
                         else {"engine": kind, "error": out.stderr[-1500:]})
    batch, continuous = results["vllm-batch"], results["vllm"]
    summary = {}
    if "error" not in batch and "error" not in continuous:
        summary = {"tokens_per_s_ratio": continuous["tokens_per_s"] / batch["tokens_per_s"],
                   "p99_latency_ratio": continuous["p99_latency_s"] / batch["p99_latency_s"]}
    return {"workload": workload, "results": list(results.values()), "continuous_over_batch": summary}


if __name__ == "__main__":
    kind, *numbers = sys.argv[1:]
    print(json.dumps(measure(kind, *map(int, numbers))), flush=True)
