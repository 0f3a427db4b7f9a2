"""YAML with bounds: every YAML file we read (a training ``--config``, an export's
``config.yaml``, a ``key=value`` override) goes through :func:`load_bounded`.

``yaml.safe_load`` never runs code, but it expands aliases: a few hundred bytes of nested
``&a [*a, *a, ...]`` anchors describe a document of billions of nodes (the "billion laughs"),
which took 10 s, 2.5 GB and a 580 MB error message before this module existed. Here the
document is first *composed* (aliases stay references to one node, so this is cheap), its
expanded size is counted with memoisation, and only a document within the bounds is
*constructed* into Python objects. Recursive aliases are refused outright.

A mapping that repeats a key is refused too, naming both lines: PyYAML keeps the last value
silently, so a second ``model:`` section replaced the first and a 1-layer, d=32 config trained
6 layers at d=512.
"""

from __future__ import annotations

from typing import Any

import yaml

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import quote

MAX_BYTES = 1 << 20
"""Largest YAML text we parse (1 MiB; our configs are ~2 KB)."""
MAX_NODES = 100_000
"""Largest document, counted with every alias expanded (our configs have ~100 nodes)."""


class YAMLLimitError(UserError, ValueError):
    """A YAML document over the bounds (or recursive): the message names the source."""


def _expanded_size(root: yaml.Node, where: str, limit: int) -> int:
    """Nodes of the document with every alias expanded; stops counting past ``limit``."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise YAMLLimitError(f"{where}: recursive YAML alias (a node that contains itself)")
        on_path.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                break
        on_path.discard(key)
        sizes[key] = total
        return total

    return size(root)


class YAMLDuplicateKeyError(YAMLLimitError):
    """A mapping in a YAML document repeats a key: the message names the source and lines."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_duplicate_keys(root: yaml.Node, where: str) -> None:
    """Raise :class:`YAMLDuplicateKeyError` for the first mapping that repeats a scalar key
    (compared by resolved tag and text, so ``a`` and ``"a"`` are the same key)."""
    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                    ident = (key_node.tag, key_node.value)
                    line = key_node.start_mark.line + 1
                    if ident in first_line:
                        raise YAMLDuplicateKeyError(
                            f"{where}: line {line}: duplicate key {quote(key_node.value)} "
                            f"(first at line {first_line[ident]}); a repeated key or section "
                            "would silently replace the first, so merge them into one"
                        )
                    first_line[ident] = line
                stack.append(value_node)
                stack.append(key_node)


def load_bounded(
    text: str, where: str, max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES
) -> Any:
    """``yaml.safe_load(text)`` for a document of at most ``max_bytes`` characters and
    ``max_nodes`` nodes once aliases are expanded; :class:`YAMLLimitError` (naming ``where``)
    otherwise, and :class:`YAMLDuplicateKeyError` for a mapping that repeats a key. Syntax
    errors are PyYAML's ``yaml.YAMLError``."""
    if len(text) > max_bytes:
        raise YAMLLimitError(
            f"{where}: {len(text):,} characters of YAML, more than the {max_bytes:,} we read"
        )
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = _expanded_size(node, where, max_nodes)
        if n > max_nodes:
            raise YAMLLimitError(
                f"{where}: the YAML expands to more than {max_nodes:,} nodes (anchors and "
                "aliases multiply it); refusing to read it"
            )
        _refuse_duplicate_keys(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()
