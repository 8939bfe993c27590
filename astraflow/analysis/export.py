"""`astraflow export RUN_DIR --format parquet|jsonl [--text]`: a run's trajectories as one
file that pandas, DuckDB and Hugging Face `datasets` read with no AstraFlow code.

One row per stored trajectory: the row table's columns (`policy` and `worker` as text, the
shard and row it came from), `prompt_ids` (the tokens before the first one the record's policy
generated) and `completion_ids` (the rest: the policy's tokens and, in multi-turn episodes,
the tool and environment turns between them), `completion_tokens` (how many tokens the
policy generated), and its metadata as a JSON string (`meta`). With `text`, `prompt` and
`completion` decoded by the run's tokenizer (special tokens kept: they mark the turns).

Reads the shards a shard at a time (`iter_trajectories`) and writes in batches of
`BATCH_ROWS`, so memory stays at one shard's data and one batch. The output is written
under a temporary name and renamed, so a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from astraflow.config.rundir import RunDir, existing_run
from astraflow.store.reader import iter_trajectories

FORMATS = ("parquet", "jsonl")
BATCH_ROWS = 4096
DROPPED = ("offset", "meta_offset", "meta_length")  # positions inside a shard: nothing outside it


def export_run(run_dir: str | Path, fmt: str, out: str | Path | None = None, text: bool = False) -> Path:
    """Write the export (default: RUN_DIR/trajectories.<fmt>); returns its path."""
    run_dir = existing_run(run_dir)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {list(FORMATS)}")
    out = Path(out) if out is not None else run_dir / f"trajectories.{fmt}"
    decode = _decoder(run_dir) if text else None
    tmp = out.with_name(out.name + ".tmp")
    batches = _batches(run_dir, decode)
    if fmt == "jsonl":
        with open(tmp, "w") as f:
            for batch in batches:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in batch)
    else:
        _write_parquet(tmp, batches)
    os.replace(tmp, out)
    return out


def _records(run_dir: Path, decode: Any) -> Iterator[dict[str, Any]]:
    for t in iter_trajectories(run_dir, ("tokens", "loss_mask")):
        mask = t.pop("loss_mask").astype(bool)
        tokens = t.pop("tokens")
        first = int(np.argmax(mask)) if mask.any() else len(tokens)
        record = {k: v for k, v in t.items() if k not in DROPPED}
        record["meta"] = json.dumps(record["meta"], ensure_ascii=False)
        record.update(prompt_ids=tokens[:first].tolist(), completion_ids=tokens[first:].tolist(),
                      completion_tokens=int(mask.sum()))
        if decode is not None:
            record.update(prompt=decode(record["prompt_ids"]), completion=decode(record["completion_ids"]))
        yield record


def _batches(run_dir: Path, decode: Any) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for record in _records(run_dir, decode):
        batch.append(record)
        if len(batch) == BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_parquet(path: Path, batches: Iterator[list[dict[str, Any]]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    try:
        for batch in batches:
            table = pa.Table.from_pylist(batch)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table.cast(writer.schema))
    finally:
        if writer is not None:
            writer.close()
    if writer is None:  # no trajectories: an empty file with no columns still reads
        pq.write_table(pa.table({}), path)


def _decoder(run_dir: Path) -> Any:
    """Token ids -> text with the tokenizer of the run's starting model (every version of the
    weights shares it)."""
    from astraflow.models import base_model_dir
    from astraflow.models.tokenizer import load_hf_tokenizer

    run = RunDir.open(run_dir)
    tokenizer = load_hf_tokenizer(base_model_dir(run.path, run.config.model.path))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
