"""Filesystem primitives of the weight channel: URIs, and directories made visible atomically.

A version is written under `.<name>.tmp/` next to its final place, its files fsynced, then
renamed to `<name>` and the parent fsynced (`commit_dir`): a reader sees a complete version
or none. Files that are the same in every version (config, tokenizer) are hard links to the
base model's where the filesystem allows. The URI handed to the dataflow rank is
`file://<absolute path>`; the channel crosses job and region boundaries because it is only
files on the shared filesystem.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

# everything but the weights a loader needs: AutoTokenizer reads the eos, pad and chat template
# from tokenizer_config.json, not from tokenizer.json
COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


def path_of(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise ValueError(f"weights URI {uri!r}: only file:// is served by the filesystem channel")
    return Path(parsed.path)


def uri_of(path: Path) -> str:
    return f"file://{Path(path).resolve()}"


def link_model_files(base_model_dir: Path, dst: Path) -> None:
    """Config and tokenizer files of the base model into `dst` (an HF directory needs them)."""
    for name in COPIED:
        src = Path(base_model_dir) / name
        if src.exists():
            try:
                os.link(src, dst / name)
            except OSError:  # another filesystem, or one without hard links
                shutil.copy(src, dst / name)
                fsync_file(dst / name)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fresh_tmp(final: Path) -> Path:
    """An empty `.<name>.tmp` beside `final` (a leftover of a killed writer is discarded)."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Make `tmp` (its files already fsynced) visible as `final`, which must not exist."""
    if final.exists():
        raise FileExistsError(f"{final} exists: a published version is never replaced")
    os.rename(tmp, final)
    fsync_dir(final.parent)
