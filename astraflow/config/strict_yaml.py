"""The YAML every config and site profile is read with: PyYAML's safe loader, stricter.

Refused, each as a `yaml.MarkedYAMLError` that points at the offending line (the loader turns
it into a one-line `ConfigError`):
- aliases (`*name`): each one repeats a whole subtree, so a kilobyte of nested aliases
  expands to billions of nodes (the "billion laughs"); a config has no need for them;
- nesting deeper than `MAX_DEPTH`: the composer recurses once per level, and a kilobyte of
  `[[[[...` would end in a RecursionError;
- a key given twice in one mapping (PyYAML keeps the last one silently), naming both lines.
Unknown tags (`!!python/object`, `!foo`) are refused by the safe constructor itself.
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

MAX_DEPTH = 64


class StrictLoader(yaml.SafeLoader):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise ComposerError(None, None, f"alias *{event.anchor}: anchors and aliases are not accepted "
                                f"(an alias can expand exponentially); write the value out", event.start_mark)
        if self.depth >= MAX_DEPTH:
            raise ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: {...}`: merged keys may be overridden, that is what it is for
            key = self.construct_object(key_node)
            try:
                seen = key in first
            except TypeError:
                continue  # an unhashable key: the safe constructor refuses it below
            if seen:
                raise ConstructorError(None, None, f"duplicate key {key!r} (first given at line {first[key]})",
                                       key_node.start_mark)
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def compose_and_load(text: str) -> tuple[yaml.Node | None, Any]:
    """The document's node tree (for line numbers) and its value; None, None for an empty one."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    finally:
        loader.dispose()
