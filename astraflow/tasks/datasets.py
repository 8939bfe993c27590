"""Data sets as prompt sources: JSONL, Parquet and `datasets`' `save_to_disk` directories.

Rows are read on demand, never all held in memory: a JSONL file keeps only the byte offset
of each line; a Parquet file one row group at a time; a saved `datasets` directory is
memory-mapped Arrow. Building a source reads every row once to validate it and to hash its
content (the key of its split, `sources._split`), so a bad row stops the run before any
component starts, in one line naming the file, the line (JSONL) or row index and the field.

Field mapping (`tasks.*_key`): the prompt is a string field, or a chat `messages` field (a
non-empty list of {"role", "content"} strings); the answer a string or a number; an optional
worked solution a string. Every other field of the row reaches user rewards as `row`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from astraflow.config.loader import ConfigError
from astraflow.config.schema import TaskSourceConfig

if TYPE_CHECKING:
    from astraflow.tasks.sources import Item

BATCH_ROWS = 8192  # rows validated per Arrow batch
MISSING = object()


def _key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _bad(where: str, field: str, expected: str, value: Any) -> ConfigError:
    got = "missing" if value is MISSING else f"got {type(value).__name__} {json.dumps(value, default=str)[:60]}"
    return ConfigError(f"{where}: field {field!r}: expected {expected}, {got}")


def to_item(row: dict[str, Any], cfg: TaskSourceConfig, where: str) -> "Item":
    """One validated row as an Item; `where` names it in errors ("file:line", "file: row 7")."""
    from astraflow.tasks.sources import Item

    messages: tuple[dict[str, str], ...] = ()
    if cfg.messages_key:
        value = row.get(cfg.messages_key, MISSING)
        ok = isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
        if not ok:
            raise _bad(where, cfg.messages_key, 'a non-empty list of {"role": str, "content": str}', value)
        messages, prompt = tuple({"role": m["role"], "content": m["content"]} for m in value), ""
    else:
        prompt = row.get(cfg.prompt_key, MISSING)
        if not isinstance(prompt, str) or not prompt:
            raise _bad(where, cfg.prompt_key, "a non-empty string", prompt)
    answer = row.get(cfg.answer_key, MISSING)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise _bad(where, cfg.answer_key, "a string or a number", answer)
    solution = row.get(cfg.solution_key, "") if cfg.solution_key else ""
    if not isinstance(solution, str):
        raise _bad(where, cfg.solution_key, "a string", solution)
    used = {cfg.prompt_key, cfg.answer_key, cfg.messages_key, cfg.solution_key}
    return Item(prompt, str(answer), solution, messages, {k: v for k, v in row.items() if k not in used})


def _item_key(item: "Item") -> int:
    return _key(json.dumps([item.prompt, list(item.messages), item.answer], sort_keys=True))


def _path(cfg: TaskSourceConfig) -> Path:
    path = Path(cfg.path)
    if not path.exists():
        raise ConfigError(f"tasks.path: {path} does not exist (tasks.kind is {cfg.kind!r})")
    return path


class JsonlRows:
    """One JSON object per line; blank lines are skipped. Keeps line offsets only."""

    def __init__(self, cfg: TaskSourceConfig) -> None:
        self.cfg, self.path = cfg, _path(cfg)
        offsets, keys, lines = [], [], []
        try:
            with open(self.path, "rb") as f:
                for no, line in enumerate(iter(f.readline, b""), 1):
                    if line.strip():
                        self._parse(line, no)
                        offsets.append(f.tell() - len(line))
                        keys.append(_key(line.decode("utf-8", "replace").strip()))
                        lines.append(no)
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot read prompts: {e.strerror}") from None
        self.offsets = np.array(offsets, np.int64)
        self.lines = np.array(lines, np.int64)
        self.keys = np.array(keys, np.uint64)

    def _parse(self, line: bytes, no: int) -> "Item":
        where = f"{self.path}:{no}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
        return to_item(row, self.cfg, where)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> "Item":
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[index]))
            return self._parse(f.readline(), int(self.lines[index]))

    def content_keys(self) -> np.ndarray:
        return self.keys


class ArrowRows:
    """Rows of Arrow record batches (Parquet, saved `datasets`): validated batch by batch;
    random access through `_row`."""

    def __init__(self, cfg: TaskSourceConfig, where: str, batches: Iterator[Any], columns: list[str]) -> None:
        self.cfg, self.where = cfg, where
        missing = [k for k in (cfg.messages_key or cfg.prompt_key, cfg.answer_key, cfg.solution_key)
                   if k and k not in columns]
        if missing:
            raise ConfigError(f"{where}: no field {missing[0]!r}; the data set has {columns}")
        keys, start = [], 0
        for batch in batches:
            for i, row in enumerate(batch.to_pylist()):
                keys.append(_item_key(to_item(row, cfg, f"{where}: row {start + i}")))
            start += batch.num_rows
        self.keys = np.array(keys, np.uint64)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> "Item":
        return to_item(self._row(index), self.cfg, f"{self.where}: row {index}")

    def _row(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def content_keys(self) -> np.ndarray:
        return self.keys


class ParquetRows(ArrowRows):
    def __init__(self, cfg: TaskSourceConfig) -> None:
        import pyarrow.parquet as pq

        path = _path(cfg)
        try:
            self.file = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
            raise ConfigError(f"{path}: not a readable Parquet file ({e})") from None
        names = self.file.schema_arrow.names
        used = [k for k in (cfg.prompt_key, cfg.messages_key, cfg.answer_key, cfg.solution_key) if k and k in names]
        self.group_ends = np.cumsum([self.file.metadata.row_group(g).num_rows
                                     for g in range(self.file.num_row_groups)])
        self._group: tuple[int, list[dict]] = (-1, [])
        super().__init__(cfg, str(path), self.file.iter_batches(batch_size=BATCH_ROWS, columns=used), names)

    def _row(self, index: int) -> dict[str, Any]:
        g = int(np.searchsorted(self.group_ends, index, side="right"))
        if self._group[0] != g:  # tasks are read in a shuffled order: one row group at a time
            self._group = (g, self.file.read_row_group(g).to_pylist())
        return self._group[1][index - (int(self.group_ends[g - 1]) if g else 0)]


class DiskDatasetRows(ArrowRows):
    """A directory written by `datasets` `Dataset.save_to_disk` (or a DatasetDict's, with `tasks.split`)."""

    def __init__(self, cfg: TaskSourceConfig) -> None:
        from datasets import DatasetDict, load_from_disk

        path = _path(cfg)
        try:
            data = load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ConfigError(f"{path}: not a saved `datasets` directory ({e})") from None
        if isinstance(data, DatasetDict):
            if cfg.split not in data:
                raise ConfigError(f"tasks.split: {cfg.split!r} is not a split of {path}; expected one of {list(data)}")
            data = data[cfg.split]
        self.data = data
        super().__init__(cfg, str(path), data.data.to_batches(max_chunksize=BATCH_ROWS), data.column_names)

    def _row(self, index: int) -> dict[str, Any]:
        return self.data[index]
