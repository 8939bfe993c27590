"""Prompt sources: where tasks come from.

A source is a fixed list of (prompt, answer) items split once, by a seeded permutation, into
a held-out evaluation split (never handed out for training), a warm-up split (supervised
warm-up only) and the training split; the three are disjoint. Task
ids are dense integers; task `i` is training item `perm_e[i % n]` of epoch `e = i // n`,
each epoch with its own seeded permutation. The mapping is a pure function of the config,
so a restarted dataflow rank hands out exactly the same task for the same id.

Registry: `SOURCES` (explicit table, name -> builder).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from astraflow.config.loader import ConfigError
from astraflow.config.schema import TaskSourceConfig


@dataclass(frozen=True)
class Item:
    prompt: str
    answer: str


def arithmetic_items(cfg: TaskSourceConfig) -> list[Item]:
    """Every `a+b=` and `a-b=` (non-negative results; `ops` selects) with operands in [0, max_operand].

    `answer` asks for the full result, its units digit, or its parity (0 even, 1 odd).
    `pad_operands` writes operands zero-padded to one width ("07+15=") and `reverse_answer`
    asks for the result's digits least significant first ("22" for 07+15, "42" for 09+15),
    so that each answer digit depends on operand digits at fixed positions plus a carry.
    None of these made the tiny model generalise to held-out prompts in minutes yet (see
    docs/architecture.md, "Measured so far").
    """
    m = cfg.max_operand
    width = len(str(m)) if cfg.pad_operands else 0
    show = {"full": str, "units": lambda r: str(r % 10), "parity": lambda r: str(r % 2)}[cfg.answer]

    def item(a: int, op: str, b: int, r: int) -> Item:
        text = show(r)
        return Item(f"{a:0{width}d}{op}{b:0{width}d}=", text[::-1] if cfg.reverse_answer else text)

    if cfg.operands > 2:  # sums of several operands: "3+4+2="
        return [Item("+".join(f"{x:0{width}d}" for x in xs) + "=",
                     show(sum(xs))[::-1] if cfg.reverse_answer else show(sum(xs)))
                for xs in itertools.product(range(m + 1), repeat=cfg.operands)]
    items = []
    if "+" in cfg.ops:
        items += [item(a, "+", b, a + b) for a in range(m + 1) for b in range(m + 1)]
    if "-" in cfg.ops:
        items += [item(a, "-", b, a - b) for a in range(m + 1) for b in range(a + 1)]
    return items


def jsonl_items(cfg: TaskSourceConfig) -> list[Item]:
    path = Path(cfg.path)
    items = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read prompts: {e.strerror}") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{no}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f"{path}:{no}: expected an object with a string \"prompt\"")
        answer = row.get("answer", "")
        if not isinstance(answer, (str, int, float)):
            raise ConfigError(f"{path}:{no}: \"answer\" must be a string or a number")
        items.append(Item(row["prompt"], str(answer)))
    return items


SOURCES: dict[str, Callable[[TaskSourceConfig], list[Item]]] = {
    "arithmetic": arithmetic_items,
    "jsonl": jsonl_items,
}


class TaskSource:
    def __init__(self, cfg: TaskSourceConfig) -> None:
        items = SOURCES[cfg.kind](cfg)
        if len(items) <= cfg.heldout + cfg.warmup:
            raise ConfigError(f"tasks: the {cfg.kind} source has {len(items)} items, not enough for "
                              f"heldout={cfg.heldout} + warmup={cfg.warmup} plus training")
        perm = np.random.default_rng([cfg.seed, 0]).permutation(len(items))
        cut = cfg.heldout + cfg.warmup
        self.heldout = [items[i] for i in perm[: cfg.heldout]]
        self.warmup = [items[i] for i in perm[cfg.heldout:cut]]
        self.train = [items[i] for i in perm[cut:]]
        self.cfg = cfg
        self._epoch_perm: dict[int, np.ndarray] = {}

    @property
    def limit(self) -> int | None:
        return self.cfg.max_tasks or None

    def item(self, task_id: int) -> Item:
        return self.train[self.index(task_id)]

    def index(self, task_id: int) -> int:
        """The training item that task `task_id` hands out."""
        n = len(self.train)
        epoch, i = divmod(task_id, n)
        perm = self._epoch_perm.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.cfg.seed, 1, epoch]).permutation(n)
            self._epoch_perm = {epoch: perm}  # tasks are drawn in order: keep one epoch
        return int(perm[i])
