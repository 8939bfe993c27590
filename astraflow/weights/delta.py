"""Sparse deltas between two publications of the same model.

A delta holds, per tensor that changed, where its changed elements are and their new values
in the tensor's dtype; "changed" is bitwise on the published dtype (`tensors.bits`). RL
updates at small learning rates move few bf16 elements per step (each element moves by about
lr per AdamW step, and its bf16 rounding flips with probability ~lr / ulp: 1-5% at lr 1e-6),
so a delta is a few percent of the full version.

Positions are gaps, one byte each: the distance from the previous changed element (the
first: its index + 1) as k bytes of 255 and one byte of the remainder (gap = 255k + r, r <
255), so that decoding is a cumsum: `indices = cumsum(bytes)[bytes != 255] - 1`. With a few
percent of elements changed nearly every gap is under 255: a changed bf16 element costs 3
bytes instead of 6 with int32 indices (that halving is what brings a delta at lr 1e-6 under
5% of the full version). In a file the two arrays of tensor `name` are `name::gaps` (uint8)
and `name::values`.

`apply` patches a state dict in place; the caller verifies the patched tensors against the
target version's manifest (`reader.py`).
"""
from __future__ import annotations

import torch

from astraflow.weights.tensors import bits

GAPS, VALUES = "::gaps", "::values"
Delta = dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (gaps, uint8; new values)


def make(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], limit: int | None = None
         ) -> tuple[Delta | None, int]:
    """What changed from `old` to `new` (same names, shapes and dtypes), on `new`'s device, and
    how many elements changed. None instead of the delta once it would exceed `limit` bytes
    (counted at one byte per position, a lower bound): the rest is only counted, not encoded
    (encoding nearly every element of a large model took 30 s of a 0.5B model's publication)."""
    if old.keys() != new.keys():
        raise ValueError(f"a delta needs the same tensors: {sorted(old.keys() ^ new.keys())[:5]} differ")
    out: Delta | None = {}
    changed = size = 0
    for name, b in new.items():
        a = old[name].to(b.device)  # a resumed publisher's previous version was read on the CPU
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: {tuple(a.shape)} {a.dtype} -> {tuple(b.shape)} {b.dtype}: not a delta")
        flat = b.reshape(-1)
        differs = bits(a).reshape(-1) != bits(flat)
        n = int(differs.sum())
        changed += n
        size += n * (1 + b.element_size())
        if limit is not None and size > limit:
            out = None
        if out is not None and n:
            idx = torch.nonzero(differs, as_tuple=True)[0]
            out[name] = (encode(idx), flat[idx])
    return out, changed


def encode(indices: torch.Tensor) -> torch.Tensor:
    """Increasing flat indices as one-byte gaps (see the module's docstring)."""
    gaps = torch.diff(indices, prepend=indices.new_full((1,), -1))
    k = gaps // 255
    out = torch.full((int(k.sum()) + len(gaps),), 255, dtype=torch.uint8, device=indices.device)
    out[torch.cumsum(k + 1, 0) - 1] = (gaps % 255).to(torch.uint8)
    return out


def decode(gaps: torch.Tensor) -> torch.Tensor:
    """The flat indices that `encode` encoded (int64)."""
    wide = gaps.to(torch.int64)
    return torch.cumsum(wide, 0)[gaps != 255] - 1


def to_file(delta: Delta) -> dict[str, torch.Tensor]:
    """The tensors of a delta file, in order."""
    return {k: v for name, (gaps, val) in delta.items() for k, v in ((name + GAPS, gaps), (name + VALUES, val))}


def from_file(tensors: dict[str, torch.Tensor]) -> Delta:
    """A delta from a delta file's tensors; ValueError naming the first thing out of place."""
    out: Delta = {}
    for key in tensors:
        if not key.endswith(GAPS):
            if not (key.endswith(VALUES) and key[: -len(VALUES)] + GAPS in tensors):
                raise ValueError(f"delta entry {key!r} has no partner")
            continue
        name = key[: -len(GAPS)]
        gaps, val = tensors[key], tensors.get(name + VALUES)
        if val is None or gaps.dtype != torch.uint8 or gaps.dim() != 1 or val.dim() != 1:
            raise ValueError(f"delta of {name}: expected uint8 gaps and a 1-d array of values")
        out[name] = (gaps, val)
    return out


def apply(state: dict[str, torch.Tensor], delta: Delta) -> None:
    """Patch `state` in place; ValueError before any change if the delta does not fit it."""
    indices = {}
    for name, (gaps, val) in delta.items():
        t = state.get(name)
        if t is None or val.dtype != t.dtype:
            raise ValueError(f"delta of {name}: the state has {'no such tensor' if t is None else t.dtype}")
        idx = decode(gaps)
        if len(idx) != len(val) or (len(idx) and int(idx[-1]) >= t.numel()):
            raise ValueError(f"delta of {name}: {len(idx)} positions up to {int(idx[-1]) if len(idx) else -1} for "
                             f"{len(val)} values in {t.numel()} elements")
        indices[name] = idx
    for name, (_, val) in delta.items():
        state[name].view(-1)[indices[name]] = val


def payload_bytes(delta: Delta) -> int:
    return sum(gaps.numel() + val.numel() * val.element_size() for gaps, val in delta.values())
