"""Tensors as raw bytes: the one definition of a tensor's checksum and of its safetensors dtype.

A tensor's checksum is xxh3-64 (hex) of its bytes in memory order, contiguous, as they are
written to a safetensors file: the publisher computes it while writing and a reader after
loading or patching, so both compare the same thing. Comparisons of weights are bitwise on the published dtype (`bits`): a NaN equals
itself and -0.0 differs from 0.0, which is what "the engine holds exactly these weights" means.
"""
from __future__ import annotations

import numpy as np
import torch
import xxhash

# torch dtype <-> the safetensors header's name for it
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
# torch dtype <-> its name in manifests ("bfloat16")
NAMES: dict[torch.dtype, str] = {d: str(d).removeprefix("torch.") for d in ST_DTYPES}
BY_NAME = {v: k for k, v in NAMES.items()}
# the integer type of each float width: bitwise comparison of floats
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array (a view where the tensor is contiguous on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def xxh3(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(raw(t))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view of `t` as integers of its width, for bitwise comparison."""
    return t.view(_BITS[t.element_size()]) if t.dtype != torch.bool else t


def dtype_named(name: str) -> torch.dtype:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown tensor dtype {name!r}; known: {sorted(BY_NAME)}") from None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
