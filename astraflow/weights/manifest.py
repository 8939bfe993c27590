"""What a published version directory holds, and how version directories are named.

`RUN_DIR/weights/<policy>/v<N>` (or `v<N>-<k>`: version N published again, k-th time, by a
trainer that replayed step N after a restart — a directory a worker may be reading is never
replaced) holds `manifest.json`:

    {"format": 1, "version": N, "kind": "full" | "delta", "base": "v<N-1>" | "",
     "dtype": "bfloat16", "tensors": {name: {"shape": [...], "dtype": ..., "xxh3": ...}},
     "files": {file: xxh3}, "changed": int, "elements": int}

`tensors` describes the whole model *after* this version (a delta's too), so whoever
materialises it checks every tensor against it; `files` are the checksums of the files the
version wrote (computed while writing). A full version is an HF model directory
(`model.safetensors` + config and tokenizer files); a delta holds `delta.safetensors`, the
changed elements of each changed tensor against `base` (`weights/delta.py`). A full version
may hold a delta against its `base` too, so that a worker behind it can still catch up by
deltas (`reader.py`); a delta version always has a base. `changed` counts the elements that
differ from the previous publication (-1: unknown, the first version a trainer publishes).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
FULL_FILE = "model.safetensors"
DELTA_FILE = "delta.safetensors"
FORMAT = 1
_NAME = re.compile(r"^v(\d+)(?:-(\d+))?$")


class WeightsError(Exception):
    """A published version that cannot be read or does not match its manifest."""


@dataclass(frozen=True)
class TensorInfo:
    shape: list[int]
    dtype: str
    xxh3: str


@dataclass(frozen=True)
class Manifest:
    version: int
    kind: str  # "full" | "delta"
    base: str  # the directory `delta.safetensors` applies to; "" (full versions only): no delta
    dtype: str  # the publish dtype
    tensors: dict[str, TensorInfo]
    files: dict[str, str]
    changed: int = -1  # elements that differ from the previous publication (-1: unknown)
    elements: int = 0
    name: str = field(default="", compare=False)  # the directory's name (not stored)

    @property
    def full(self) -> bool:
        return self.kind == "full"

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("name")
        return json.dumps({"format": FORMAT, **d})


def dir_name(version: int, k: int = 0) -> str:
    return f"v{version}" if k == 0 else f"v{version}-{k}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(version, k) of a version directory's name, None for anything else."""
    match = _NAME.match(name)
    return (int(match[1]), int(match[2] or 0)) if match else None


def version_dirs(policy_dir: Path) -> list[Path]:
    """The policy's published version directories, oldest first (by version, then k)."""
    try:
        found = [(parse_name(p.name), p) for p in Path(policy_dir).iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []
    return [p for key, p in sorted((k, p) for k, p in found if k is not None)]


def newest_dir(policy_dir: Path, version: int | None = None) -> Path | None:
    """The newest directory of `version` (its last re-publication), or of any version."""
    dirs = [p for p in version_dirs(policy_dir) if version is None or parse_name(p.name)[0] == version]
    return dirs[-1] if dirs else None


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise WeightsError(f"{path}: missing (not a published version, or deleted)") from None
    except OSError as e:
        raise WeightsError(f"{path}: unreadable manifest ({type(e).__name__}: {e})") from None
    return parse_manifest(text, Path(directory).name, str(path))


def parse_manifest(text: str, name: str, where: str) -> Manifest:
    """A manifest from its JSON text (`where` names it in errors): WeightsError if malformed."""
    try:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise WeightsError(f"{where}: format {d.get('format')!r}, expected {FORMAT}")
        tensors = {n: TensorInfo(list(t["shape"]), str(t["dtype"]), str(t["xxh3"])) for n, t in d["tensors"].items()}
        manifest = Manifest(int(d["version"]), str(d["kind"]), str(d["base"]), str(d["dtype"]), tensors,
                            {str(k): str(v) for k, v in d["files"].items()}, int(d.get("changed", -1)),
                            int(d.get("elements", 0)), name=name)
    except WeightsError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError(f"{where}: unreadable manifest ({type(e).__name__}: {e})") from None
    if manifest.kind not in ("full", "delta") or (manifest.kind == "delta" and not manifest.base):
        raise WeightsError(f"{where}: kind {manifest.kind!r} with base {manifest.base!r}: expected a full version, "
                           "or a delta with a base")
    expected = ({FULL_FILE} if manifest.full else set()) | ({DELTA_FILE} if manifest.base else set())
    if set(manifest.files) != expected:
        raise WeightsError(f"{where}: files {sorted(manifest.files)}, expected {sorted(expected)}")
    return manifest
