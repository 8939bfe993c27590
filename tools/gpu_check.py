"""The GPU checks in one go: one NVIDIA GPU, torch with CUDA, transformers, no vLLM, no network.

    PYTHONPATH=. python3 tools/gpu_check.py [--sizes 0.5b 1.5b] [--backends torch megatron]
                                            [--seq 4096] [--out gpu_check.json]

For each model shape (Qwen2.5-shaped, built from config with a locally trained tokenizer, the
real vocabulary size of 151,936), on the GPU the launcher would assign, in the run's compute
dtype (bf16 with fp32 master weights and optimizer state), for each trainer backend:
- logprob parity: the backend's scoring (chunked or vocabulary-parallel, bf16) of `--seq`
  token sequences against an fp32 full-vocabulary pass of the Hugging Face model loaded from
  the same directory (max and mean |diff|);
- optimizer steps on served batches of `--seq`-token sequences (the last 7/8 of each
  trained, as completions are), micro-batched by a token budget, with activation
  checkpointing (Megatron's full recompute): tokens/s, model FLOP utilisation against the
  bf16 dense peak (6·N + 12·layers·hidden·seq FLOPs per token), peak memory;
and once per shape the hf engine generating on the GPU: tokens/s for `--gen-prompts` prompts
× `--gen-tokens`. Each result is also printed on stderr as soon as it is known, so a run cut
short still reports what it measured.
Prints one JSON object (also written to `--out`). `--cpu` runs the same code on the CPU with
whatever shape is given (the test suite does, with `--sizes tiny`), so the script is known to
run before a GPU is at hand.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from astraflow import hardware  # noqa: E402
from astraflow.config.loader import parse_config  # noqa: E402
from astraflow.models.directory import check_model_dir  # noqa: E402
from astraflow.models.factory import make_model  # noqa: E402
from astraflow.protocol import messages as m  # noqa: E402
from astraflow.rollout.engines.base import SamplingParams  # noqa: E402
from astraflow.rollout.engines.hf import HFEngine  # noqa: E402
from astraflow.trainer.batch import TokenBatch  # noqa: E402
from astraflow.trainer.loop import BACKENDS  # noqa: E402

BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, vendors' datasheets


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in BF16_PEAK.items() if k in name), None)


def served_batch(rows: int, seq: int, vocab: int, rng: np.random.Generator) -> m.BatchReply:
    prompt = seq // 8
    trajs = []
    for _ in range(rows):
        tokens = rng.integers(0, vocab, seq).astype(np.int32)
        mask = np.r_[np.zeros(prompt), np.ones(seq - prompt)].astype(np.uint8)
        trajs.append(m.Trajectory("policy", tokens, (-rng.random(seq) * mask).astype(np.float32), mask,
                                  np.where(mask, 0, -1).astype(np.int32), np.where(mask, 0, -1).astype(np.int8),
                                  float(rng.random())))
    return m.BatchReply(1, False, m.TrajectoryBatch.from_trajectories(trajs), np.arange(rows), np.zeros(rows, np.int64),
                        rng.standard_normal(rows).astype(np.float32), np.zeros(rows, np.float32),
                        np.ones(rows, np.float32))


def train_check(model_dir: Path, backend_name: str, dtype: str, seq: int, rows: int, steps: int,
                micro_rows: int) -> dict:
    info = check_model_dir(model_dir)
    cfg = parse_config(f"policies: [{{name: policy}}]\nengine: {{temperature: 1.0}}\nmodel: {{dtype: {dtype}}}\n"
                       f"trainer: {{backend: {backend_name}, batch_size: {rows}, minibatches: 1,"
                       f" max_tokens_per_microbatch: {micro_rows * seq}, activation_checkpointing: true,"
                       f" logprob_chunk_tokens: 2048}}\n")
    reply = served_batch(rows, seq, info.vocab_size, np.random.default_rng(0))
    backend = BACKENDS[backend_name](model_dir, cfg, "policy", 0, 1)
    params = sum(p.numel() for p in backend.model.parameters())
    parity = parity_check(backend, model_dir, reply, min(seq, 1024))  # before training: the weights on disk
    if torch.cuda.is_available():  # the peak of training: the model, optimizer and steps, not the parity pass
        torch.cuda.reset_peak_memory_stats()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    backend.train_step(reply, 1, 1e-6)  # warm-up: allocator, kernels
    sync()
    t0 = time.perf_counter()
    for step in range(steps):
        stats = backend.train_step(reply, step + 2, 1e-6)
    sync()
    seconds = (time.perf_counter() - t0) / steps
    tokens_per_s = rows * seq / seconds
    flops_per_token = 6 * params + 12 * info.layers * info.hidden * seq
    peak = peak_flops()
    return {"params": params, "seq": seq, "rows": rows, "micro_rows": micro_rows, "step_s": seconds,
            "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops_per_token / peak if peak else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "loss": stats["loss"], "dtype": str(backend.dtype), "parity": parity}


def parity_check(backend: Any, model_dir: Path, reply: m.BatchReply, length: int) -> dict:
    """The backend's scoring in its compute dtype against an fp32 full-vocabulary pass of the
    Hugging Face model in the same directory."""
    from transformers import AutoModelForCausalLM

    t = reply.trajectories
    rows = [t.tokens[t.offsets[i]:t.offsets[i] + length].tolist() for i in range(2)]
    ours = backend.score(TokenBatch.of_rows(rows))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(backend.device).eval()
    with torch.no_grad():
        ids = torch.tensor(rows, device=backend.device)
        ref = torch.log_softmax(hf(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    del hf
    d = (ours - ref.reshape(-1).cpu()).abs()
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "tokens": len(d)}


def generation_check(model_dir: Path, prompts: int, new_tokens: int) -> dict:
    engine = HFEngine(model_dir, max_batch=prompts)
    rng = np.random.default_rng(1)
    vocab = check_model_dir(model_dir).vocab_size
    batch = [rng.integers(0, vocab, 64).tolist() for _ in range(prompts)]
    params = SamplingParams(new_tokens, 1.0, ignore_eos=True)

    async def run() -> float:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params) for p in batch))
        assert all(o.decoded == new_tokens for o in outs)
        return time.perf_counter() - t0

    asyncio.run(run())  # warm-up
    seconds = asyncio.run(run())
    engine.close()
    return {"prompts": prompts, "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": prompts * new_tokens / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], help="qwen2.5 shapes (tiny, small on a CPU)")
    p.add_argument("--backends", nargs="+", default=["torch", "megatron"], choices=sorted(BACKENDS))
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="model.dtype (auto: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rows", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro-rows", type=int, default=4, help="sequences per micro-batch (the token budget / seq)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--gen-prompts", type=int, default=64, help="0: no generation check")
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--cpu", action="store_true", help="allow running without a GPU (small shapes only)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_check: no CUDA device (use --cpu to run the same code on the CPU)", file=sys.stderr)
        return 2
    report: dict = {"torch": torch.__version__, "device": hardware.describe(), "results": {}}
    with tempfile.TemporaryDirectory(prefix="astraflow-gpu-check-") as tmp:
        for size in args.sizes:
            t0 = time.perf_counter()
            model_dir = make_model("qwen2.5", size, Path(tmp) / size, corpus=["What is 12 + 7? \\boxed{19}"])
            result: dict = {"build_s": time.perf_counter() - t0}
            checks = [(f"train_{b}", lambda b=b: train_check(model_dir, b, args.dtype, args.seq, args.rows, args.steps,
                                                             args.micro_rows)) for b in args.backends]
            if args.gen_prompts:
                checks.append(("generate", lambda: generation_check(model_dir, args.gen_prompts, args.gen_tokens)))
            for name, check in checks:
                try:
                    result[name] = check()
                except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
                    result[name] = {"error": f"{type(e).__name__}: {e}"}
                gc.collect()  # the backend of one check is gone before the next is built
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(json.dumps({size: {name: result[name]}}), file=sys.stderr, flush=True)
            report["results"][size] = result
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all("error" not in v for r in report["results"].values() for v in r.values() if isinstance(v, dict)) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
