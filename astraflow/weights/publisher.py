"""Trainer side of the filesystem channel: publish each version as a full copy or a sparse delta.

The publisher keeps the last published weights in the publish dtype on the model's device
(one more copy of the model in that dtype), so a delta is a device-side comparison, and
writes each version into its own directory (`manifest.py`):
- full when there is no previous publication in this process (the first version after a
  (re)start), when `full_every` versions have passed since the last full one (1: every
  version is full), or when the delta would be larger than half the full version (at the
  quickstart's learning rate nearly every element moves; such a delta is not encoded past
  that point, and after one the next is counted before it is made: encoding them cost a
  0.5B model's publication 15-30 s);
- a delta against the previous publication otherwise.
A full version also holds its delta against the previous publication where that delta is
small, so a worker behind it can go on by deltas instead of reading the full file.
Checksums are computed while the files are written (`writer.py`), never by reading back; a
delta's manifest lists every tensor's checksum after the update (unchanged tensors keep the
previous publication's). A version published again (a trainer replaying step N after a
restart) gets a new directory `v<N>-<k>`; nothing published is ever replaced.

A tied weight (lm_head = embed_tokens) is published once, under its first name, as HF does.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from astraflow.weights import delta as deltas
from astraflow.weights.fs import commit_dir, fresh_tmp, link_model_files, uri_of, write_synced
from astraflow.weights.manifest import (DELTA_FILE, FULL_FILE, MANIFEST, Manifest, TensorInfo, dir_name,
                                        newest_dir, parse_name, read_manifest)
from astraflow.weights.tensors import NAMES, nbytes, xxh3
from astraflow.weights.writer import write_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Publication:
    manifest: Manifest
    uri: str
    base_uri: str  # the version a delta version needs ("" for a full version)
    bytes_written: int  # the weights files (full and/or delta)
    full_bytes: int  # what a full version of this model is in the publish dtype
    delta_bytes: int  # the delta against the previous publication, written or not (-1: none, or over half the full)
    seconds: float

    @property
    def full(self) -> bool:
        return self.manifest.full


def _first_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    return next(iter(tensors.values())).dtype if tensors else torch.float32


def publishable(state_dict: dict[str, torch.Tensor], dtype: Any) -> dict[str, torch.Tensor]:
    """The tensors to publish: tied duplicates dropped, cast to `dtype` (None: as they are),
    detached copies that the next optimizer step cannot change."""
    out, seen = {}, set()
    for name, t in state_dict.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().to(dtype=dtype or t.dtype, copy=True).contiguous()
    return out


class Publisher:
    def __init__(self, weights_root: Path, policy: str, base_model_dir: Path, dtype: Any = None,
                 full_every: int = 10) -> None:
        self.dir = Path(weights_root) / policy
        self.base_model_dir = Path(base_model_dir)
        self.dtype, self.full_every = dtype, max(1, full_every)
        self.last: dict[str, torch.Tensor] | None = None  # the last publication, publish dtype, model's device
        self.last_manifest: Manifest | None = None
        self.since_full = 0  # deltas published since the last full version
        # the last delta was over half the full version: the next is only counted first (the
        # learning rate seldom drops at once), and made in a second pass only if it is small
        self.last_too_large = False

    def adopt(self, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
        """Continue from an existing publication (a resumed trainer: `state_dict` is that
        version as `load_version` read and verified it): the next version may be a delta against it."""
        self.last = publishable(state_dict, self.dtype)
        self.last_manifest = read_manifest(directory)
        chain, m = 0, self.last_manifest
        while not m.full and chain < self.full_every:
            chain += 1
            m = read_manifest(self.dir / m.base)
        self.since_full = chain

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> Publication:
        t0 = time.perf_counter()
        tensors = publishable(state_dict, self.dtype)
        full_bytes = sum(nbytes(t) for t in tensors.values())
        # over half the full version (nearly every element moved: a high learning rate), it is not made
        limit = full_bytes // 2
        delta, changed = self._delta(tensors, 0 if self.last_too_large else limit)
        elements = sum(t.numel() for t in tensors.values())
        if delta is None and changed > 0 and self.last_too_large and changed * (1 + full_bytes / elements) <= limit:
            delta, changed = self._delta(tensors, limit)  # small again: make it
        delta_bytes = deltas.payload_bytes(delta) if delta is not None else -1
        if delta_bytes > limit:  # the bound above counts a position as one byte: at most a little more
            delta, delta_bytes = None, -1
        self.last_too_large = delta is None and changed > 0
        full = delta is None or self.since_full + 1 >= self.full_every
        final = self.dir / self._free_name(version)
        tmp = fresh_tmp(final)
        meta = {"format": "pt", "version": str(version)}
        files, written = {}, 0
        if full:
            files[FULL_FILE], sums = write_file(tmp / FULL_FILE, tensors, meta)
            written += full_bytes
        if delta is not None:
            files[DELTA_FILE], _ = write_file(tmp / DELTA_FILE, deltas.to_file(delta), meta)
            written += delta_bytes
            if not full:
                sums = {n: (xxh3(tensors[n]) if n in delta else self.last_manifest.tensors[n].xxh3) for n in tensors}
        base = self.last_manifest.name if delta is not None else ""
        manifest = Manifest(version, "full" if full else "delta", base, NAMES[self.dtype or _first_dtype(tensors)],
                            {n: TensorInfo(list(t.shape), NAMES[t.dtype], sums[n]) for n, t in tensors.items()},
                            files, changed, elements, name=final.name)
        write_synced(tmp / MANIFEST, manifest.to_json())
        if full:
            link_model_files(self.base_model_dir, tmp)
        commit_dir(tmp, final)
        self.last, self.last_manifest = tensors, manifest
        self.since_full = 0 if full else self.since_full + 1
        base_uri = uri_of(self.dir / base) if base and not full else ""  # what the version needs to be read
        return Publication(manifest, uri_of(final), base_uri, written, full_bytes, delta_bytes,
                           time.perf_counter() - t0)

    def _delta(self, tensors: dict[str, torch.Tensor], limit: int) -> tuple[deltas.Delta | None, int]:
        """The delta against the last publication and the elements changed (None, -1: there
        is none, or of another shape; None, n: over `limit` bytes)."""
        if self.last is None:
            return None, -1
        try:
            return deltas.make(self.last, tensors, limit)
        except ValueError as e:  # another model shape: cannot be a delta
            log.warning("publishing a full version: %s", e)
            return None, -1

    def _free_name(self, version: int) -> str:
        """`v<N>`, or `v<N>-<k>` past the last directory of version N (a replayed step)."""
        last = newest_dir(self.dir, version)
        return dir_name(version) if last is None else dir_name(version, parse_name(last.name)[1] + 1)
