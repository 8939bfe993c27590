"""docs/configuration.md is what `python -m astraflow.config.reference` renders from the
schema now: every key of every section, with its type, default, runtime flag and comment."""
from __future__ import annotations

import dataclasses
import typing

from astraflow.config import schema
from astraflow.config.reference import DOC, field_comments, render


def test_the_committed_reference_is_current():
    assert DOC.read_text() == render(), "run: python -m astraflow.config.reference"


def all_keys() -> list[tuple[type, str]]:
    """(section class, key) of every key, nested sections' keys (metrics.wandb) included."""
    out, hints = [], typing.get_type_hints(schema.Config)
    for f in dataclasses.fields(schema.Config):
        tp = hints[f.name]
        cls = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp
        cls_hints = typing.get_type_hints(cls)
        for g in dataclasses.fields(cls):
            nested = cls_hints[g.name]
            out += [(nested, h.name) for h in dataclasses.fields(nested)] if dataclasses.is_dataclass(nested) \
                else [(cls, g.name)]
    out += [(schema.PoolConfig, g.name) for g in dataclasses.fields(schema.PoolConfig)]
    return out


def test_every_key_is_in_the_reference_with_a_description():
    text = render()
    comments = field_comments(open(schema.__file__).read())
    for cls, name in all_keys():
        assert f".{name}` |" in text, name
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        assert comments[(cls.__name__, name)] or field.metadata.get("choices"), f"{cls.__name__}.{name}: no comment"
    assert not [line for line in text.splitlines() if line.startswith("| `") and line.endswith("|  |")]
    assert "| `dataflow.lease_s` | number | `60.0` | runtime |" in text
    assert "| `store.compression` | string | `'none'` | fixed | One of `none`, `lzf`, `gzip`." in text
    assert "| `policies[].name` | string | *required* |" in text
    assert "### `metrics.wandb`" in text and "| `metrics.wandb.mode` | string | `'offline'` | runtime | One of" in text
