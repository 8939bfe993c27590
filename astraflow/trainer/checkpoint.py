"""Trainer checkpoints: `checkpoints/<policy>/step-<N>.pt` (model, optimizer, step), written
atomically (temporary file, fsync, rename); the newest `KEEP` are kept. The weight versions of
kept checkpoints are pinned: the dataflow rank's retention never deletes them."""
from __future__ import annotations

import os
from pathlib import Path

import torch

KEEP = 2


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in Path(ckpt_dir).glob("step-*.pt"))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    steps = checkpoint_steps(ckpt_dir)
    return Path(ckpt_dir) / f"step-{steps[-1]}.pt" if steps else None


def save_checkpoint(ckpt_dir: Path, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> Path:
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step-{step}.pt"
    tmp = ckpt_dir / f".step-{step}.pt.tmp"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in checkpoint_steps(ckpt_dir)[:-KEEP]:
        (ckpt_dir / f"step-{old}.pt").unlink(missing_ok=True)
    return final
