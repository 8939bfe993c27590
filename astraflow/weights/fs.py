"""Filesystem weight channel: each version published atomically as an HF model directory.

`publish()` writes `RUN_DIR/weights/<policy>/.v<N>.tmp/` (safetensors + config + tokenizer; the
last two hard links to the base model's files where the filesystem allows), fsyncs the new
files and renames the directory to `v<N>`: a reader either sees a complete version or none.
`checksum.json` holds the SHA-256 of the weights; `verify()` checks it, so a file damaged at
rest (a bad disk, a careless copy) is refused instead of loaded. The URI handed to the
dataflow rank is `file://<absolute path>`. The channel crosses job and region boundaries
because it is only files on the shared filesystem.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

# everything but the weights a loader needs: AutoTokenizer reads the eos, pad and chat template
# from tokenizer_config.json, not from tokenizer.json
COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
WEIGHTS, CHECKSUM = "model.safetensors", "checksum.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify(directory: Path) -> str | None:
    """None when the published weights in `directory` are intact, else what is wrong."""
    try:
        expected = json.loads((Path(directory) / CHECKSUM).read_text())[WEIGHTS]
        actual = sha256(Path(directory) / WEIGHTS)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{directory}: unreadable weights or checksum ({e})"
    return None if actual == expected else f"{directory}: checksum mismatch (the weights file is damaged)"


def version_dir(weights_root: Path, policy: str, version: int) -> Path:
    return Path(weights_root) / policy / f"v{version}"


def publish(state_dict: dict, base_model_dir: Path, weights_root: Path, policy: str, version: int,
            dtype: Any = None) -> str:
    """Write version `version` (in `dtype`, a torch dtype: the training dtype; None: as given)."""
    from safetensors.torch import save_file

    final = version_dir(weights_root, policy, version)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors, seen = {}, set()
    for name, tensor in state_dict.items():
        if tensor.data_ptr() not in seen:  # a tied weight (lm_head = embed_tokens) is saved once, as HF does
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "version": str(version)})
    (tmp / CHECKSUM).write_text(json.dumps({WEIGHTS: sha256(tmp / WEIGHTS)}))
    for name in (WEIGHTS, CHECKSUM):
        _fsync(tmp / name)
    for name in COPIED:  # the same every version: linked, not written and synced again
        if (Path(base_model_dir) / name).exists():
            _link_or_copy(Path(base_model_dir) / name, tmp / name)
    if final.exists():  # a re-publish after a trainer restart replaces the old copy
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"file://{final.resolve()}"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy(src, dst)
        _fsync(dst)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def path_of(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise ValueError(f"weights URI {uri!r}: only file:// is served by the filesystem channel")
    return Path(parsed.path)


def load_state_dict(uri_or_dir: str | Path) -> dict:
    from safetensors.torch import load_file

    path = path_of(uri_or_dir) if isinstance(uri_or_dir, str) and "://" in uri_or_dir else Path(uri_or_dir)
    return load_file(str(path / "model.safetensors"))
