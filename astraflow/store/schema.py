"""HDF5 shard layout (schema_version 3). Older shards lack columns, which read as
`MISSING_DEFAULTS` or 0: version 1 `guided` (0), versions 1-2 `weight` (1).

A shard is flat: per-token arrays of all its trajectories are concatenated, and a
per-trajectory table `rows` (one compound dataset, a column per field of `ROW_COLUMNS`)
indexes them with `offset`/`length`.
Free metadata is JSON, concatenated into the byte dataset `meta_bytes` (flat too: filters do
nothing on variable-length HDF5 types, and SWMR forbids creating anything once writing
starts). File attributes (`schema_version`, `policy_names`, `created`) are written before
SWMR mode is switched on and never after.

The writer appends and flushes token data before the row table, so a row is only ever
visible once the data it points to is in the file. Rows that point at nothing (a write cut
short: rows of zeros, rows past the data) end a shard's good rows: readers treat them as a
torn tail (reader.py).
"""
from __future__ import annotations

import numpy as np

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)

TOKEN_COLUMNS: dict[str, np.dtype] = {
    "tokens": np.dtype("<i4"),
    "logprobs": np.dtype("<f4"),
    "loss_mask": np.dtype("u1"),
    "versions": np.dtype("<i4"),
    "token_policy": np.dtype("i1"),
}

ROW_COLUMNS: dict[str, np.dtype] = {
    "sample_id": np.dtype("<i8"),
    "task_id": np.dtype("<i8"),
    "episode_id": np.dtype("<i8"),
    "group_id": np.dtype("<i8"),
    "policy": np.dtype("u1"),  # index into the shard's `policy_names` attribute
    "worker": np.dtype("S64"),
    "offset": np.dtype("<i8"),  # into the token datasets of this shard
    "length": np.dtype("<i4"),
    "reward": np.dtype("<f4"),
    # 1: an answer the policy did not sample — a reference answer scored by the engine
    # (`workflow.reference_guidance`), or a verdict on an answer the solver did not give
    # (`workflow.verifier_contrast`): trained like any sample, never counted in a generated reward
    "guided": np.dtype("u1"),
    # the sample's weight in a reward mean over the prompt set: 1 / its prompt's selection
    # probability (dataflow/selection.py; 1 without prompt selection)
    "weight": np.dtype("<f4"),
    "gen_s": np.dtype("<f4"),
    "t_commit": np.dtype("<f8"),  # dataflow rank's wall clock when stored
    "version_min": np.dtype("<i4"),  # over this policy's generated tokens
    "version_max": np.dtype("<i4"),
    "version_at_commit": np.dtype("<i4"),  # latest published version of the policy then
    "meta_offset": np.dtype("<i8"),
    "meta_length": np.dtype("<i4"),
}

ROW_DTYPE = np.dtype(list(ROW_COLUMNS.items()))
MISSING_DEFAULTS = {"weight": 1.0}  # a column an older shard lacks reads as this, or as 0

META_COLUMN = "meta_bytes"

# Columns the dataflow rank supplies for each appended batch (the store fills in
# the offsets and `meta_length`).
INPUT_ROW_COLUMNS = tuple(c for c in ROW_COLUMNS if c not in ("offset", "meta_offset", "meta_length"))
