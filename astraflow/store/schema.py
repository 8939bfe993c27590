"""HDF5 shard layout (schema_version 3). Older shards lack columns, which read as
`MISSING_DEFAULTS` or 0: version 1 `guided` (0), versions 1-2 `weight` (1).

A shard is flat: per-token arrays of all its trajectories are concatenated, and a
per-trajectory table `rows` (one compound dataset, a column per field of `ROW_COLUMNS`)
indexes them with `offset`/`length`.
Free metadata is JSON, concatenated into the byte dataset `meta_bytes` (flat too: filters do
nothing on variable-length HDF5 types, and SWMR forbids creating anything once writing
starts). File attributes (`schema_version`, `policy_names`, `created`, `description`,
`version_none`) and the datasets' descriptions (`COLUMN_DOCS`: meaning and unit of every
column) are written before SWMR mode is switched on and never after.

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

# What each column means, with its unit: written as attributes of the shard's datasets (the row
# table's attribute of a column's name, a token dataset's `description`), so a shard read with
# plain h5py describes itself. Weight versions: 0 is the starting model, v the weights the
# trainer published after its step v; `VERSION_NONE` (-1) where there is no version.
VERSION_NONE = -1
COLUMN_DOCS: dict[str, str] = {
    "tokens": "token ids of every trajectory, concatenated (a row's offset and length select its own)",
    "logprobs": "log-probability (natural log) of each token under the weights that generated it; 0 for "
                "tokens no policy generated",
    "loss_mask": "1 on the tokens this record's policy generated and trains on, 0 elsewhere",
    "versions": "weight version that generated each token (0: the starting model, v: published after trainer "
                "step v); -1 where no policy generated it (prompt, tool and environment tokens)",
    "token_policy": "index into the file attribute policy_names of the policy that generated each token; -1 for "
                    "prompt, tool and environment tokens",
    "meta_bytes": "per-record JSON metadata, concatenated (a row's meta_offset and meta_length select its own)",
    "sample_id": "the record's id, unique in the run; the unit a trainer consumes",
    "task_id": "the task (prompt) this record answers",
    "episode_id": "the episode (one rollout of the task) this record is from",
    "group_id": "the group of samples of one prompt whose rewards are compared (advantages)",
    "policy": "index into the file attribute policy_names",
    "worker": "id of the rollout worker that generated it (UTF-8)",
    "offset": "index of the record's first token in the token datasets",
    "length": "number of tokens (prompt included)",
    "reward": "the record's reward (the task's reward function)",
    "guided": "1: an answer the policy did not sample (a reference answer, or a verdict on an answer the solver "
              "did not give); it is trained on but never counted in a generated reward",
    "weight": "weight in a reward mean over the prompt set: 1 / the prompt's selection probability",
    "gen_s": "seconds the worker spent generating the episode (wall clock)",
    "t_commit": "when the dataflow rank stored it: seconds since the Unix epoch (the rank's wall clock)",
    "version_min": "oldest weight version among this policy's generated tokens (see versions)",
    "version_max": "newest weight version among this policy's generated tokens",
    "version_at_commit": "latest version of the policy's weights published when it was stored; -1: none was "
                         "published yet (the starting model, version 0, generated it). Version lag: this minus "
                         "version_min, where this is not -1",
    "meta_offset": "index of the record's first byte in meta_bytes",
    "meta_length": "bytes of the record's JSON metadata (0: none)",
}
MISSING_DEFAULTS = {"weight": 1.0}  # a column an older shard lacks reads as this, or as 0

META_COLUMN = "meta_bytes"

# Columns the dataflow rank supplies for each appended batch (the store fills in
# the offsets and `meta_length`).
INPUT_ROW_COLUMNS = tuple(c for c in ROW_COLUMNS if c not in ("offset", "meta_offset", "meta_length"))
