"""Weight-version registry: the latest published version per policy, and retention.

Trainers announce each version with `published(policy, version, uri, pinned, full, base)`;
workers ask `weights(policy)`. Retention keeps the last K versions, every version a
checkpoint still references (`pinned`), and, transitively, the base of every kept delta
version — so every kept version can still be read, the newest full version and every delta
after it included. A version published again (a trainer replayed its step after a restart)
has a new URI; the directory it replaces is retired with the other versions below the kept
ones, not at once (a worker may be reading it). Only `file://` URIs inside this run's
`weights/` directory are ever deleted, and the deleting happens in a thread of its own
(`Deleter`): removing a model's files takes seconds at LLM scale, and the rank's loop does
no file I/O beyond its store and journal.
"""
from __future__ import annotations

import logging
import queue
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Version:
    uri: str
    full: bool = True
    base: str = ""  # the URI a delta version is read on top of


@dataclass
class PolicyWeights:
    versions: dict[int, Version] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)
    replaced: list[tuple[int, str]] = field(default_factory=list)  # (version, uri) published again since

    @property
    def latest(self) -> int:
        return max(self.versions, default=-1)


class Deleter:
    """Removes retired version directories in a thread, in the order they were retired."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Path] = queue.Queue()
        threading.Thread(target=self._run, name="weights-deleter", daemon=True).start()

    def delete(self, path: Path) -> None:
        self.queue.put(path)

    def wait(self) -> None:
        """Until everything retired so far is deleted (tests)."""
        self.queue.join()

    def _run(self) -> None:
        while True:
            path = self.queue.get()
            try:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                self.queue.task_done()


class WeightRegistry:
    def __init__(self, weights_dir: Path, keep: dict[str, int]) -> None:
        self.dir = weights_dir.resolve()
        self.keep = keep
        self.policies: dict[str, PolicyWeights] = {p: PolicyWeights() for p in keep}
        self.deleter = Deleter()

    def latest(self, policy: str) -> tuple[int, str]:
        pw = self.policies[policy]
        v = pw.latest
        return v, pw.versions[v].uri if v in pw.versions else ""

    def publish(self, policy: str, version: int, uri: str, pinned: list[int], full: bool = True, base: str = "",
                delete: bool = True) -> list[str]:
        """Record a version; the URIs retired by it (deleted in the background unless `delete` is false)."""
        pw = self.policies[policy]
        old = pw.versions.get(version)
        if old is not None and old.uri != uri:
            pw.replaced.append((version, old.uri))
        pw.versions[version] = Version(uri, full, base)
        pw.pinned = set(pinned)
        keep = self._kept(pw, self.keep[policy])
        retired = [pw.versions.pop(v).uri for v in sorted(pw.versions) if v not in keep]
        oldest_kept = min(keep, default=version)
        retired += [u for v, u in pw.replaced if v < oldest_kept]
        pw.replaced = [(v, u) for v, u in pw.replaced if v >= oldest_kept]
        if delete:
            for u in retired:
                self._delete(u)
        return retired

    @staticmethod
    def _kept(pw: PolicyWeights, k: int) -> set[int]:
        """The last k versions, the pinned ones, and the bases they are read on top of."""
        by_uri = {ver.uri: v for v, ver in pw.versions.items()}
        keep = set(sorted(pw.versions)[-k:]) | (pw.pinned & pw.versions.keys())
        todo = list(keep)
        while todo:
            ver = pw.versions[todo.pop()]
            base = by_uri.get(ver.base) if not ver.full else None
            if base is not None and base not in keep:
                keep.add(base)
                todo.append(base)
        return keep

    def _delete(self, uri: str) -> None:
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            return
        path = Path(parsed.path).resolve()
        if self.dir not in path.parents:
            log.warning("not deleting %s: outside %s", path, self.dir)
            return
        self.deleter.delete(path)
