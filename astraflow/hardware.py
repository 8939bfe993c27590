"""What a component runs on: its device (the GPU Slurm or torchrun assigns it), the compute
dtype, and a description for `Register`/`Ready` and `astraflow status`.

The local rank is `LOCAL_RANK` (torchrun), else `SLURM_LOCALID` (srun), else 0; the device
is that GPU among those `CUDA_VISIBLE_DEVICES` leaves visible (modulo their number: a task
that Slurm bound to one GPU sees it as cuda:0), or the CPU without CUDA. torch is imported
inside the functions: the launcher and the dataflow rank never load it.
"""
from __future__ import annotations

import os
import platform
from typing import Any


def local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def device() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def compute_dtype(name: str, on: Any = None) -> Any:
    """`auto`: bfloat16 on a GPU, float32 on a CPU; else the named dtype."""
    import torch

    if name == "auto":
        return torch.bfloat16 if (on or device()).type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def describe() -> str:
    """"NVIDIA H200 (cuda:0 of 4, 139 GiB)" or "cpu: AMD EPYC 9654 (2 cores)"."""
    import torch

    if torch.cuda.is_available():
        d = device()
        props = torch.cuda.get_device_properties(d)
        return f"{props.name} (cuda:{d.index} of {torch.cuda.device_count()}, {props.total_memory / 2**30:.0f} GiB)"
    return f"cpu: {_cpu_model()} ({len(os.sched_getaffinity(0))} cores)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
