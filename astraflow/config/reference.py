"""docs/configuration.md, generated from the config schema (`schema.py`): every key of every
section with its type, default, whether it may change on an existing run (`--set` on a run
directory: the `runtime` fields) and the comment it carries in the schema.

The schema is the single source: comments are read from `schema.py` itself (the comment lines
right above a field and the comment at the end of its line), sections' descriptions from the
classes' docstrings. `python -m astraflow.config.reference` rewrites the file; a unit test
checks that the committed file is what this renders, so the reference cannot fall behind.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

from astraflow.config import schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from `astraflow/config/schema.py` by `python -m astraflow.config.reference`; do not
edit by hand (a test checks that this file is current).

A run's config is YAML with the sections below; every key is optional unless marked
*required*. Unknown keys, wrong types and values outside a key's choices are refused before
anything starts, naming the file and line (or the `--set` that gave the value). Override any
key on the command line with `--set SECTION.KEY=VALUE` (policies by name:
`--set policies.NAME.KEY=VALUE`). Once a run directory exists its config is fixed, except the
keys marked *runtime*, which `--set` may change when the run is resumed.
"""


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> its comment in `source`: the comment lines just above the
    field and the comment at the end of its line, joined."""
    comments: dict[int, str] = {}
    whole_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[:tok.start[1]].strip():
                whole_line.add(tok.start[0])
    out = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                above, line = [], node.lineno - 1
                while line in whole_line:
                    above.insert(0, comments[line])
                    line -= 1
                trailing = [comments[node.lineno]] if node.lineno in comments and node.lineno not in whole_line else []
                out[(cls.name, node.target.id)] = " ".join(above + trailing)
    return out


def _type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list of {_type(typing.get_args(tp)[0])}"
    if origin is not None:  # X | None
        return " or ".join("null" if a is type(None) else _type(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(tp.__name__, tp.__name__)


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "*required*"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == ():
        return "[]"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _literal(value: str) -> str:
    return f"`{value}`" if value else '`""`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(cls: type, prefix: str, comments: dict[tuple[str, str], str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | changes on a run | description |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue  # a nested section: a table of its own
        note = comments.get((cls.__name__, f.name), "")
        choices = f.metadata.get("choices")
        if choices:
            note = f"One of {', '.join(_literal(c) for c in choices)}. {note}".strip()
        rows.append(f"| `{prefix}{f.name}` | {_type(hints[f.name])} | {_cell(_default(f))} | "
                    f"{'runtime' if f.metadata.get('runtime') else 'fixed'} | {_cell(note)} |")
    return rows


def _doc(cls: type) -> list[str]:
    own = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""
    return [" ".join(own.split()), ""] if own else []


def render() -> str:
    comments = field_comments(Path(schema.__file__).read_text())
    hints = typing.get_type_hints(schema.Config)
    out = [HEADER]
    for f in dataclasses.fields(schema.Config):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None
        cls = item or tp
        out += [f"## `{f.name}`" + (" (a list: one item per policy)" if item else ""), ""]
        table = _table(cls, f"{f.name}[]." if item else f"{f.name}.", comments)
        out += _doc(cls) + (table + [""] if len(table) > 2 else [])
        for sub in dataclasses.fields(cls):  # nested sections (metrics.wandb), lists of them (rollout.pools)
            sub_tp = typing.get_type_hints(cls)[sub.name]
            if dataclasses.is_dataclass(sub_tp):
                out += [f"### `{f.name}.{sub.name}`", ""]
                out += _doc(sub_tp) + _table(sub_tp, f"{f.name}.{sub.name}.", comments) + [""]
            elif typing.get_origin(sub_tp) is tuple and dataclasses.is_dataclass(typing.get_args(sub_tp)[0]):
                nested = typing.get_args(sub_tp)[0]
                out += [f"### `{f.name}.{sub.name}` items", ""]
                out += _doc(nested) + _table(nested, f"{f.name}.{sub.name}[].", comments) + [""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    DOC.write_text(render())
    print(DOC, file=sys.stderr)
