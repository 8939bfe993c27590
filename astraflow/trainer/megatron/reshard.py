"""A megatron checkpoint read back at its own tensor/pipeline layout or cut again for another.

A checkpoint (`backend.save`) is a directory of `tp<t>-pp<p>-dp<d>.pt` files, one per stage,
tensor-parallel rank and optimizer shard, each holding `{parameter name: {"master": fp32
tensor, "adam": AdamW state}}` for the parameters that shard owns; the file names alone give
the layout it was saved at. `read(path, tp_rank, pp_rank, tp, pp, spec)` returns what rank
(`tp_rank`, `pp_rank`) of a `tp` × `pp` trainer needs:

- at the saved layout, its own files' entries (any number of data-parallel shards merged);
- at another layout, every file is read and each quantity shaped like its parameter (the
  master and AdamW's two moments) is put back into Hugging Face layout with the weight
  mapping (`mapping.from_stages`, `mapping.to_hf`) and cut again for this rank
  (`mapping.to_megatron`, `mapping.to_stage`). The mapping only slices and concatenates, so a
  resharded master or moment is bit-exact; AdamW's step count is the same for every parameter
  and is carried as it is.

Resharding holds the whole model's masters and moments in memory on every rank while it
loads (three fp32 copies of the model): it suits moving a run to another layout, not a
checkpoint format for models larger than a rank's memory.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from astraflow.trainer.megatron.mapping import from_stages, to_hf, to_megatron, to_stage
from astraflow.trainer.megatron.spec import ModelSpec

FILE = re.compile(r"^tp(\d+)-pp(\d+)-dp(\d+)\.pt$")
MOMENTS = ("exp_avg", "exp_avg_sq")


def layout(path: Path) -> tuple[int, int, list[tuple[int, int, Path]]]:
    """(tp, pp) a checkpoint was saved at, and its files with their tensor-parallel rank and stage."""
    files = [(int(m.group(1)), int(m.group(2)), f) for f in Path(path).iterdir() if (m := FILE.match(f.name))]
    if not files:
        raise ValueError(f"{path}: no tp<t>-pp<p>-dp<d>.pt files: not a checkpoint of the megatron backend")
    return max(t for t, _, _ in files) + 1, max(p for _, p, _ in files) + 1, files


def read(path: Path, tp_rank: int, pp_rank: int, tp: int, pp: int, spec: ModelSpec
         ) -> tuple[int, dict[str, dict[str, Any]]]:
    """(the saved step, {parameter name: {"master", "adam"}}) for rank (tp_rank, pp_rank) of a
    tp x pp trainer (see the module's docstring)."""
    saved_tp, saved_pp, files = layout(path)
    same = (saved_tp, saved_pp) == (tp, pp)
    parts: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    step = None
    for t, p, f in files:
        if same and (t, p) != (tp_rank, pp_rank):
            continue
        state = torch.load(f, weights_only=True, map_location="cpu")
        parts.setdefault((t, p), {}).update(state["masters"])
        step = int(state["step"])
    if same:
        return step, parts[tp_rank, pp_rank]
    return step, _cut(parts, saved_tp, saved_pp, spec, tp_rank, pp_rank, tp, pp)


def _cut(parts: dict[tuple[int, int], dict[str, dict[str, Any]]], saved_tp: int, saved_pp: int, spec: ModelSpec,
         tp_rank: int, pp_rank: int, tp: int, pp: int) -> dict[str, dict[str, Any]]:
    def recut(get: Any) -> dict[str, torch.Tensor]:
        shards = [from_stages([{n: get(e) for n, e in parts[t, p].items()} for p in range(saved_pp)], spec)
                  for t in range(saved_tp)]
        return to_stage(to_megatron(to_hf(shards, spec), spec, tp, tp_rank), spec, pp, pp_rank)

    out = {name: {"master": tensor, "adam": {}} for name, tensor in recut(lambda e: e["master"]).items()}
    stepped = next(iter(parts[0, 0].values()))["adam"]
    if stepped:  # saved after at least one optimizer step
        for moment in MOMENTS:
            for name, tensor in recut(lambda e: e["adam"][moment]).items():
                out[name]["adam"][moment] = tensor
        for entry in out.values():
            entry["adam"]["step"] = stepped["step"].clone()
    return out
