"""A safetensors file written as a stream, checksummed while it is written — never read back.

Format (the one `safetensors.torch.load_file` reads): 8 bytes little-endian header length, a
JSON header `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}`
padded with spaces to a multiple of 8 bytes, then every tensor's raw bytes back to back in
header order. Each tensor is moved to the CPU, written and hashed one at a time, so a
publication never holds a second full copy of the model in host memory.

`write_file` returns the xxh3-64 of the whole file (every byte written, header included) and
of each tensor's bytes (`tensors.xxh3`'s definition); the file is fsynced before it returns.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable

import torch
import xxhash

from astraflow.weights.tensors import ST_DTYPES, nbytes, raw


def header(tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The length prefix and the padded JSON header of a file holding `tensors` in this order."""
    entries: dict[str, dict] = {}
    offset = 0
    for name, t in tensors:
        if t.dtype not in ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be written to safetensors")
        size = nbytes(t)
        entries[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Write `tensors` to `path`; (xxh3 of the file, {name: xxh3 of the tensor's bytes})."""
    items = list(tensors.items())
    whole = xxhash.xxh3_64()
    sums: dict[str, str] = {}
    with open(path, "wb") as f:
        head = header(items, metadata)
        f.write(head)
        whole.update(head)
        for name, t in items:
            data = raw(t)
            f.write(memoryview(data))
            whole.update(data)
            sums[name] = xxhash.xxh3_64_hexdigest(data)
        f.flush()
        os.fsync(f.fileno())
    return whole.hexdigest(), sums
