"""`astraflow bench weights`: what the filesystem weight channel moves, and how long it takes,
for a model of realistic shape trained by real optimizer steps.

A model built from config (`models/factory.make_model`; by default Qwen2.5-shaped 0.5B, 494 M
parameters) is trained, from the same start at each learning rate, by AdamW steps on fp32
master weights (a language-model loss on random tokens: a real gradient, real optimizer
state). After every step the trainer's `Publisher` publishes the version in `--dtype` (bf16:
the training dtype of a bf16 trainer) — the first full, the others sparse deltas against the
previous version — and a worker's `Follower` brings it into an hf engine (one worker, in this
process: the read, the verification and the install a worker does, without the control-plane
round trip that tells it of the version). Per version: bytes of the full version in fp32 and
in the publish dtype, bytes of the delta, the fraction of published elements that changed,
the publish time, the time until the engine holds the version (from the start of the
publication), and the engine's pause (its batch lock is held only to install). Summaries are
medians over the versions after the first (`--versions` of them; a delta over half the full
version is not even made, its bytes are null, and the version is published full;
`published_as_delta` counts the others).
"""
from __future__ import annotations

import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

from astraflow.config.schema import WeightsConfig

BATCH, TOKENS = 2, 64  # the training batch of each step: 2 sequences of 64 random tokens


def _step(model, optim, vocab: int, generator) -> None:
    import torch

    ids = torch.randint(vocab, (BATCH, TOKENS), generator=generator)
    optim.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()


def measure_lr(model_dir: Path, weights_root: Path, engine, lr: float, versions: int, dtype, first: int) -> dict:
    """Train `versions + 1` steps at `lr`, publishing and applying each version."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.weights.follower import Follower
    from astraflow.weights.publisher import Publisher

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)  # foreach: one more model-sized temporary
    publisher = Publisher(weights_root, f"lr{lr:g}", model_dir, dtype, full_every=versions + 2)
    follower = Follower(weights_root / f"lr{lr:g}")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i in range(versions + 1):
        t0 = time.perf_counter()
        _step(model, optim, model.config.vocab_size, generator)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pub = publisher.publish(model.state_dict(), first + i)
        published = time.perf_counter()
        update = asyncio.run(follower.bring(engine, weights_root / f"lr{lr:g}" / pub.manifest.name))
        applied = time.perf_counter()
        assert update.version == first + i, update  # the engine holds the version just published
        rows.append({"version": i + 1, "kind": pub.manifest.kind, "train_s": train_s,
                     "fp32_full_bytes": pub.manifest.elements * 4,
                     "full_bytes": pub.full_bytes, "delta_bytes": pub.delta_bytes if pub.delta_bytes >= 0 else None,
                     "changed_fraction": pub.manifest.changed / pub.manifest.elements if pub.manifest.changed >= 0
                     else None, "bytes_written": pub.bytes_written, "publish_s": pub.seconds,
                     "read_s": update.seconds, "bytes_read": update.bytes_read, "how": update.how,
                     "paused_s": applied - published - update.seconds, "applied_s": applied - t0})
    del model, optim, publisher, follower
    gc.collect()
    later = rows[1:]  # each has a delta against the one before, published as such unless over half the full

    def median(key: str) -> float | None:  # None: not known for every version (a delta over half the full)
        values = [r[key] for r in later]
        return None if None in values else statistics.median(values)

    full = rows[0]
    return {"lr": lr, "versions": rows, "fp32_full_bytes": full["fp32_full_bytes"], "full_bytes": full["full_bytes"],
            "delta_bytes": median("delta_bytes"), "changed_fraction": median("changed_fraction"),
            "delta_over_full": None if median("delta_bytes") is None else median("delta_bytes") / full["full_bytes"],
            "publish_s": median("publish_s"),
            "applied_s": median("applied_s"), "paused_s": median("paused_s"), "first_publish_s": full["publish_s"],
            "first_applied_s": full["applied_s"], "published_as_delta": sum(r["kind"] == "delta" for r in later)}


def full_version(model_dir: Path, weights_root: Path, dtype):
    """The starting model published as one full version: (its tensors in `dtype`, manifest)."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.weights.publisher import Publisher

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    publisher = Publisher(weights_root, "collective", model_dir, dtype, full_every=1)
    pub = publisher.publish(model.state_dict(), 1)
    del model
    gc.collect()
    return publisher.last, pub.manifest


def run_bench(like: str, size: str, lrs: list[float], versions: int, dtype_name: str, threads: int,
              workers: list[int] = (), rounds: int = 3, bucket_mb: float = WeightsConfig.bucket_mb,
              relay: str = WeightsConfig.relay) -> dict:
    import torch

    from astraflow.models.factory import make_model
    from astraflow.rollout.engines.hf import HFEngine
    from astraflow.weights.tensors import dtype_named

    # the caller's thread count comes back afterwards: vLLM's CPU attention in the same process
    # checks that its kernels run with the count its metadata was built with
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = dtype_named(dtype_name)
        with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
            t0 = time.perf_counter()
            model_dir = make_model(like, size, Path(tmp) / "model", corpus=["What is 12 + 7? 19"])
            build_s = time.perf_counter() - t0
            engine = HFEngine(model_dir, threads=threads)
            parameters = sum(p.numel() for p in engine.model.parameters())
            results = [measure_lr(model_dir, Path(tmp) / "weights", engine, lr, versions, dtype, 1 + 100 * i)
                       for i, lr in enumerate(lrs)]
            engine.close()
            collective = None
            if workers:
                from astraflow.bench.weights_collective import measure

                tensors, manifest = full_version(model_dir, Path(tmp) / "weights", dtype)
                collective = measure(tensors, manifest, model_dir, dtype_name, list(workers), rounds, bucket_mb, relay,
                                     threads)
    finally:
        torch.set_num_threads(previous)
    return {"like": like, "size": size, "parameters": parameters, "dtype": dtype_name, "workers": 1,
            "channel": "filesystem", "build_s": build_s, "threads": threads, "results": results,
            "collective": collective}
