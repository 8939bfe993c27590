"""Prompt sources: where tasks come from, split into held-out, warm-up and training parts.

A source is a list of rows (`Rows`: a generator's items in memory, or a data set read on
demand) split once into a held-out evaluation part (never handed out for training), a
warm-up part (supervised warm-up only) and the training part; the three are disjoint.
- Generated sources split by a seeded permutation (their rows never change).
- Data sets split by a seeded hash of each row's content: a row keeps its split when rows
  are appended (exactly for fractional sizes; for counts, a new row takes a held-out place
  only if it hashes below the last one), and identical rows always share a split, so a
  duplicated prompt cannot leak from training into the evaluation.

Task ids are dense integers; task `i` is training row `perm_e[i % n]` of epoch `e = i // n`,
each epoch with its own seeded permutation. The mapping is a pure function of the config,
so a restarted dataflow rank hands out exactly the same task for the same id.

Registry: `SOURCES` (explicit table, kind -> builder). Every row is validated when the
source is built, so a bad row stops the run before any component starts, naming its file,
line (or row) and field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from astraflow.config.loader import ConfigError
from astraflow.config.schema import TaskSourceConfig
from astraflow.tasks import code_problems, datasets, generators, search_facts


@dataclass(frozen=True)
class Item:
    prompt: str
    answer: str  # what the reward compares with
    solution: str = ""  # a worked solution (warm-up target, reference guidance); "" = the answer
    messages: tuple[dict[str, str], ...] = ()  # chat messages in place of the prompt text
    row: dict[str, Any] = field(default_factory=dict, compare=False)  # the row's other fields, for user rewards

    @property
    def target(self) -> str:
        """The completion a supervised example or a reference answer writes out."""
        return self.solution or self.answer


class Rows(Protocol):
    """A source's rows: `len`, random access, and (data sets) a content key per row."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Item: ...

    def content_keys(self) -> np.ndarray | None: ...  # uint64 per row; None: split by permutation


class Split:
    """Some rows of a source, in a fixed order, read on demand."""

    def __init__(self, rows: Rows, indices: np.ndarray) -> None:
        self.rows, self.indices = rows, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Item:
        return self.rows[int(self.indices[i])]

    def __iter__(self) -> Iterator[Item]:
        return (self.rows[int(i)] for i in self.indices)


SOURCES: dict[str, Callable[[TaskSourceConfig], Rows]] = {
    "arithmetic": generators.arithmetic,
    "word_problems": generators.word_problems,
    "code_problems": code_problems.code_problems,
    "search_facts": search_facts.search_facts,
    "jsonl": datasets.JsonlRows,
    "parquet": datasets.ParquetRows,
    "hf_disk": datasets.DiskDatasetRows,
}


def _size(value: float, n: int, name: str) -> int:
    if value < 0:
        raise ConfigError(f"tasks.{name}: expected a count >= 1 or a fraction in [0, 1), got {value}")
    return int(value) if value >= 1 else int(round(value * n))


def _split(rows: Rows, cfg: TaskSourceConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of the held-out, warm-up and training rows."""
    n = len(rows)
    heldout, warmup = _size(cfg.heldout, n, "heldout"), _size(cfg.warmup, n, "warmup")
    if n <= heldout + warmup:
        raise ConfigError(f"tasks: the {cfg.kind} source has {n} rows, not enough for heldout={heldout} + "
                          f"warmup={warmup} plus training")
    keys = rows.content_keys()
    if keys is None:
        order = np.random.default_rng([cfg.seed, 0]).permutation(n)
    elif cfg.heldout < 1 and cfg.warmup < 1:  # fractions: thresholds on the hash, stable under appends
        u = _mix(keys, cfg.seed) / float(1 << 64)
        parts = [np.flatnonzero(u < cfg.heldout), np.flatnonzero((u >= cfg.heldout) & (u < cfg.heldout + cfg.warmup))]
        return parts[0], parts[1], np.flatnonzero(u >= cfg.heldout + cfg.warmup)
    else:
        order = np.argsort(_mix(keys, cfg.seed), kind="stable")
    cut = heldout + warmup
    return order[:heldout], order[heldout:cut], order[cut:]


def _mix(keys: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit mix of content keys (splitmix64's finaliser)."""
    x = keys.astype(np.uint64) ^ np.uint64((seed * 0x9E3779B97F4A7C15) & (2**64 - 1))
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class TaskSource:
    def __init__(self, cfg: TaskSourceConfig) -> None:
        self.cfg = cfg
        self.rows = SOURCES[cfg.kind](cfg)
        heldout, warmup, train = _split(self.rows, cfg)
        self.heldout = [self.rows[int(i)] for i in heldout]
        self.warmup = [self.rows[int(i)] for i in warmup]
        self.train = Split(self.rows, train)
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

    def corpus(self, limit: int = 20_000) -> list[str]:
        """Texts of up to `limit` rows of every split (a tokenizer is trained on them)."""
        texts = []
        for part in (self.train, self.heldout, self.warmup):
            for item, _ in zip(part, range(limit)):
                prompt = item.prompt or " ".join(m.get("content", "") for m in item.messages)
                texts.append(prompt + item.target)
        return texts
