"""Worker side of the filesystem channel: reach a published version from the one held.

A `WeightReader` keeps the weights of its current version on the CPU (publish dtype) and its
manifest. `advance(target)` follows the target's `base` links back to a full version and
takes whichever way reads fewer bytes: the deltas after the current version (one version
behind: one delta) or the last full version plus the deltas after it. Every tensor is then
checked against the target's manifest (xxh3 of each tensor patched or loaded; an unchanged
tensor's recorded checksum must equal the current one's), so what the engine gets is
bit-equal to what the trainer published. A delta's file is checked against its manifest
before it is applied, so a truncated or corrupted delta never touches the weights.

Fallbacks, each logged: a damaged directory (missing, truncated, checksum mismatch) is
remembered; the other way to the target is tried if it avoids it, else the newest full
version that loads (which may be older than the target: the worker stays behind until the
next full version). Runs in a worker thread, never on an event loop: it reads and hashes.
`load_version` materialises any published version (the evaluation, `answers`, standby
workers and tests read published weights through it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

from astraflow.weights import delta as deltas
from astraflow.weights.manifest import (DELTA_FILE, FULL_FILE, Manifest, WeightsError, newest_dir, parse_name, read_manifest,
                                        version_dirs)
from astraflow.weights.tensors import NAMES, xxh3

log = logging.getLogger(__name__)

MAX_CHAIN = 10_000  # a longer chain of deltas is a loop in the manifests, not a publication
Step = tuple[Manifest, str]  # a version and the file to take it from: its full file or its delta


@dataclass(frozen=True)
class Update:
    version: int
    name: str  # the directory now held
    how: str  # "delta" (from the held version), "full" (a full version and the deltas after it), "fallback", "held"
    bytes_read: int
    seconds: float
    # the tensors that differ from the version held before (None: all of them, a full version was loaded)
    changed: frozenset[str] | None = None


class WeightReader:
    def __init__(self, policy_dir: Path) -> None:
        self.dir = Path(policy_dir)
        self.state: dict[str, torch.Tensor] | None = None
        self.manifest: Manifest | None = None
        self.bad: set[str] = set()  # directories found damaged: never tried again

    @property
    def version(self) -> int:
        return self.manifest.version if self.manifest else -1

    def advance(self, target: Path) -> Update:
        """Hold the version in `target`, or the newest full version that loads; WeightsError if none does."""
        t0 = time.perf_counter()
        target = Path(target)
        if self.manifest is not None and target.name == self.manifest.name:
            return Update(self.version, target.name, "held", 0, 0.0, frozenset())
        problem = ""
        try:
            for how, steps in self._plans(target):
                if any(m.name in self.bad for m, _ in steps) or (how == "delta" and self.state is None):
                    continue  # found damaged by the way tried before, or that way lost the held weights
                try:
                    read, changed = self._run(steps)
                    return Update(self.version, self.manifest.name, how, read, time.perf_counter() - t0, changed)
                except WeightsError as e:
                    problem = str(e)
                    log.warning("%s: %s; trying another way", target.name, problem)
        except WeightsError as e:
            problem = str(e)
        log.warning("%s: cannot reach it (%s); falling back to the newest full version that loads", target.name, problem)
        return self._newest_full(target, t0, problem)

    # ----------------------------------------------------------------- plans
    def _plans(self, target: Path) -> list[tuple[str, list[Step]]]:
        """Ways to the target, cheapest first, avoiding directories known to be damaged: the
        deltas after the held version, and the newest full version on the way back from the
        target with the deltas after it."""
        chain = [read_manifest(target)]  # newest first, following `base`
        held = self.manifest.name if self.manifest is not None and self.state is not None else None
        newest_full = 0 if chain[0].full else None
        held_at = None
        while chain[-1].base and (held_at is None) and (held is not None or newest_full is None):
            if len(chain) > MAX_CHAIN:
                raise WeightsError(f"{target}: a chain of more than {MAX_CHAIN} deltas")
            if chain[-1].base == held:
                held_at = len(chain)
                break
            try:
                chain.append(read_manifest(self.dir / chain[-1].base))
            except WeightsError:
                break  # the way back is cut (retention deleted it): the other way may still do
            if newest_full is None and chain[-1].full:
                newest_full = len(chain) - 1
        plans = []
        if held_at is not None:
            plans.append(("delta", [(m, DELTA_FILE) for m in chain[:held_at][::-1]]))
        if newest_full is not None:
            plans.append(("full", [(chain[newest_full], FULL_FILE)]
                          + [(m, DELTA_FILE) for m in chain[:newest_full][::-1]]))
        plans = [(how, steps) for how, steps in plans if not any(m.name in self.bad for m, _ in steps)]
        if not plans:
            raise WeightsError(f"{target}: no way to it without a damaged or missing version")
        return sorted(plans, key=lambda p: self._cost(p[1]))

    def _cost(self, steps: list[Step]) -> int:
        total = 0
        for m, file in steps:
            try:
                total += (self.dir / m.name / file).stat().st_size
            except OSError:
                return 1 << 62  # missing: the worst way
        return total

    # ----------------------------------------------------------------- loading
    def _run(self, steps: list[Step]) -> tuple[int, frozenset[str] | None]:
        """Load the steps in order (a full version first, or deltas on the held version): the
        bytes read, and the tensors changed (None: all, a full version was loaded)."""
        read, changed = 0, set()
        for m, file in steps:
            try:
                if file == FULL_FILE:
                    read += self._load_full(m)
                    changed = None
                else:
                    n, names = self._apply_delta(m)
                    read += n
                    if changed is not None:
                        changed |= names
            except WeightsError:
                self.bad.add(m.name)
                raise
        return read, None if changed is None else frozenset(changed)

    def _load_full(self, m: Manifest) -> int:
        path = self.dir / m.name / FULL_FILE
        try:
            state = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own errors for a damaged file
            raise WeightsError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
        check(state, m, state.keys())
        self.state, self.manifest = state, m
        return path.stat().st_size

    def _apply_delta(self, m: Manifest) -> tuple[int, set[str]]:
        if self.state is None or self.manifest is None or m.base != self.manifest.name:
            raise WeightsError(f"{m.name}: a delta on {m.base}, but {self.manifest and self.manifest.name} is held")
        path = self.dir / m.name / DELTA_FILE
        try:
            data = path.read_bytes()
        except OSError as e:
            raise WeightsError(f"{path}: unreadable ({e})") from None
        if xxhash.xxh3_64_hexdigest(data) != m.files.get(DELTA_FILE):
            raise WeightsError(f"{path}: checksum mismatch (truncated or damaged)")
        try:
            delta = deltas.from_file(load_bytes(data))
            if m.tensors.keys() != self.state.keys():
                raise ValueError(f"the model's tensors differ from {self.manifest.name}'s")
            for name, info in m.tensors.items():
                if name not in delta and info.xxh3 != self.manifest.tensors[name].xxh3:
                    raise ValueError(f"{name} changed but is not in the delta")
            deltas.apply(self.state, delta)
        except Exception as e:  # noqa: BLE001 - a malformed delta is refused, whatever the parser raises
            raise WeightsError(f"{path}: {type(e).__name__}: {e}") from None
        try:
            check(self.state, m, delta.keys())
        except WeightsError:
            self.state = self.manifest = None  # patched but wrong: nothing held any more
            raise
        self.manifest = m
        return len(data), set(delta)

    def _newest_full(self, target: Path, t0: float, problem: str) -> Update:
        limit = parse_name(target.name)
        for d in reversed(version_dirs(self.dir)):
            if d.name in self.bad or (limit is not None and parse_name(d.name)[0] > limit[0]):
                continue
            try:
                m = read_manifest(d)
                if not m.full:
                    continue
                read = self._load_full(m)
            except WeightsError as e:
                self.bad.add(d.name)
                log.warning("%s: %s", d.name, e)
                continue
            log.warning("holding %s (v%d) instead of %s", m.name, m.version, target.name)
            return Update(m.version, m.name, "fallback", read, time.perf_counter() - t0)
        raise WeightsError(f"{target}: {problem}; and no full version of {self.dir} loads")


def check(state: dict[str, torch.Tensor], m: Manifest, names) -> None:
    """`state` is version `m`: the same tensors, shapes and dtypes, and the tensors `names` hash
    to the manifest's checksums (the others were checked when they were loaded)."""
    if state.keys() != m.tensors.keys():
        raise WeightsError(f"{m.name}: tensors {sorted(state.keys() ^ m.tensors.keys())[:5]} differ from the manifest")
    for name in names:
        t, info = state[name], m.tensors[name]
        if list(t.shape) != info.shape or NAMES[t.dtype] != info.dtype:
            raise WeightsError(f"{m.name}: {name} is {list(t.shape)} {NAMES[t.dtype]}, the manifest says "
                               f"{info.shape} {info.dtype}")
        if xxh3(t) != info.xxh3:
            raise WeightsError(f"{m.name}: {name} does not match its checksum")


def load_version(weights_dir: Path, policy: str, version: int | None = None) -> tuple[dict[str, torch.Tensor], Manifest]:
    """The weights of a published version (its newest directory; None: the newest version),
    verified, materialised from its full version and deltas."""
    target = newest_dir(Path(weights_dir) / policy, version)
    if target is None:
        raise WeightsError(f"{Path(weights_dir) / policy}: no published version"
                           + ("" if version is None else f" {version}"))
    reader = WeightReader(target.parent)
    update = reader.advance(target)
    if update.name != target.name:
        raise WeightsError(f"{target}: damaged; the newest full version that loads is {update.name}")
    return reader.state, reader.manifest
