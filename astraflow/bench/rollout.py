"""`astraflow bench rollout`: generation throughput of the engines on the same tiny and small models.

Each (engine, size) pair runs in its own process (engines own global state: threads, vLLM's
engine core) on a freshly built model: start-up time, then `PROMPTS` concurrent requests of up
to `max_tokens` sampled at temperature 1, three times; tokens/s is the median of the three.
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

PROMPTS = 256


def measure(engine_kind: str, size: str, max_tokens: int) -> dict:
    from astraflow.models.factory import make_model
    from astraflow.models.tokenizer import ModelTokenizer
    from astraflow.rollout.engines import ENGINES
    from astraflow.rollout.engines.base import SamplingParams

    model_dir = make_model("qwen2", size, Path(tempfile.mkdtemp()) / "model", corpus=["12+7=19"])
    t0 = time.perf_counter()
    engine = ENGINES[engine_kind](str(model_dir), max_batch=PROMPTS, seed=0)
    load_s = time.perf_counter() - t0
    tokenizer = ModelTokenizer(model_dir)
    prompts = [tokenizer.encode_prompt(f"{i}+{i % 17}=") for i in range(PROMPTS)]
    params = SamplingParams(max_tokens, 1.0, stop=tokenizer.stop_ids)

    async def one_round() -> float:
        t = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return sum(len(o.tokens) for o in outs) / (time.perf_counter() - t)

    async def rounds() -> list[float]:
        await one_round()  # warm-up (compilation, caches)
        return [await one_round() for _ in range(3)]

    rates = asyncio.run(rounds())
    engine.close()
    return {"engine": engine_kind, "size": size, "load_s": load_s, "tokens_per_s": statistics.median(rates),
            "tokens_per_s_runs": rates, "prompts": PROMPTS, "max_tokens": max_tokens}


def run_bench(engines: list[str], sizes: list[str], max_tokens: int) -> dict:
    results = []
    for kind in engines:
        for size in sizes:
            out = subprocess.run([sys.executable, "-m", "astraflow.bench.rollout", kind, size, str(max_tokens)],
                                 capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            results.append(json.loads(lines[-1]) if out.returncode == 0 and lines
                           else {"engine": kind, "size": size, "error": out.stderr[-1500:]})
    return {"results": results}


if __name__ == "__main__":
    kind, size, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(measure(kind, size, max_tokens)), flush=True)
