"""An engine following a policy's published versions over the filesystem channel.

A `Follower` pairs a `WeightReader` (the weights of the version it holds, on the CPU, in the
publish dtype) with what the engine holds. `bring(engine, target)` reaches the target in a
worker thread (reading and hashing never run on the caller's event loop) and hands the
engine the reader's state with the names of the tensors that changed — only when the engine
holds the version the reader started from; otherwise (the first load, a fallback, a failed
load) every tensor. A fallback to a version older than the engine's is not installed: the
engine keeps its newer, intact weights, and the next version is installed in full.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

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
            changed = update.changed if self.installed == held_before else None
            self.installed = ""  # until the load completes
            await engine.load_state(self.reader.state, update.version, changed)
            self.installed = update.name
        return update
