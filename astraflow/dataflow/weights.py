"""Weight-version registry: the latest published version per policy, and retention.

Trainers announce each version with `published(policy, version, uri, pinned)`; workers ask
`weights(policy)`. Retention keeps the last K versions and every version a checkpoint still
references (`pinned`), and deletes the directories of the others — only `file://` URIs
inside this run's `weights/` directory are ever deleted.
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

log = logging.getLogger(__name__)


@dataclass
class PolicyWeights:
    versions: dict[int, str] = field(default_factory=dict)  # version -> uri
    pinned: set[int] = field(default_factory=set)

    @property
    def latest(self) -> int:
        return max(self.versions, default=-1)


class WeightRegistry:
    def __init__(self, weights_dir: Path, keep: dict[str, int]) -> None:
        self.dir = weights_dir.resolve()
        self.keep = keep
        self.policies: dict[str, PolicyWeights] = {p: PolicyWeights() for p in keep}

    def latest(self, policy: str) -> tuple[int, str]:
        pw = self.policies[policy]
        v = pw.latest
        return v, pw.versions.get(v, "")

    def publish(self, policy: str, version: int, uri: str, pinned: list[int], delete: bool = True) -> list[int]:
        pw = self.policies[policy]
        pw.versions[version] = uri
        pw.pinned = set(pinned)
        keep = set(sorted(pw.versions)[-self.keep[policy]:]) | pw.pinned
        retired = [v for v in pw.versions if v not in keep]
        for v in retired:
            old = pw.versions.pop(v)
            if delete:
                self._delete(old)
        return retired

    def _delete(self, uri: str) -> None:
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            return
        path = Path(parsed.path).resolve()
        if self.dir not in path.parents:
            log.warning("not deleting %s: outside %s", path, self.dir)
            return
        shutil.rmtree(path, ignore_errors=True)
