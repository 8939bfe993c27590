"""An engine following a policy's published versions over the filesystem channel.

A `Follower` pairs a `WeightReader` (the weights of the version it holds, on the CPU, in the
publish dtype) with what the engine holds. `bring(engine, target)` reaches the target in a
worker thread (reading and hashing never run on the caller's event loop) and hands the
engine the reader's state with the names of the tensors that changed — only when the engine
holds the version the reader started from; otherwise (the first load, a fallback, a failed
load) every tensor. A fallback to a version older than the engine's is not installed: the
engine keeps its newer, intact weights, and the next version is installed in full. `take`
installs a version that came over the collective channel (already verified) the same way,
and the reader holds it: the next delta from the filesystem applies on top of it.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from astraflow.weights.manifest import Manifest
from astraflow.weights.reader import Update, WeightReader


class Follower:
    def __init__(self, policy_dir: Path) -> None:
        self.reader = WeightReader(policy_dir)
        self.installed = ""  # the version directory whose weights the engine holds ("": not one of these)

    async def bring(self, engine, target: Path) -> Update:
        """Advance the reader to `target` (or the fallback it finds) and the engine with it;
        WeightsError when nothing loads, the engine's own error when the weights do not fit it."""
        held_before = self.reader.manifest.name if self.reader.manifest is not None else None
        update = await asyncio.to_thread(self.reader.advance, Path(target))
        if update.version > engine.version:
            await self._install(engine, update.name, update.version,
                                update.changed if self.installed == held_before else None)
        return update

    async def take(self, engine, tensors: dict[str, torch.Tensor], manifest: Manifest) -> frozenset[str] | None:
        """Hold a verified version that arrived another way; the tensors installed (None: all)."""
        held = self.reader.manifest
        changed = None
        if held is not None and self.installed == held.name and held.tensors.keys() == manifest.tensors.keys():
            changed = frozenset(n for n, info in manifest.tensors.items() if held.tensors[n] != info)
        self.reader.state, self.reader.manifest = tensors, manifest
        if manifest.version <= engine.version:
            self.installed = self.installed if self.installed == manifest.name else ""
            return frozenset()
        await self._install(engine, manifest.name, manifest.version, changed)
        return changed

    async def _install(self, engine, name: str, version: int, changed: frozenset[str] | None) -> None:
        self.installed = ""  # until the load completes
        await engine.load_state(self.reader.state, version, changed)
        self.installed = name
