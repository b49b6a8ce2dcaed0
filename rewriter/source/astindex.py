"""One ``ast.walk`` per file: its nodes grouped by type, shared by the engine's analyses.

The engine, the chunk pruning and the import edits each looked for a few node types (imports,
assignments, names) with their own ``ast.walk`` over the whole file; on a big file each walk costs
about as much as the ``ast.parse``. :func:`of_type` walks a tree once, keeps its nodes by type on
the tree object, and answers every later question from that.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque

_ATTRIBUTE = "_flashport_by_type"


def of_type(tree: ast.AST, *kinds: type[ast.AST]) -> list[ast.AST]:
    """The nodes of ``tree`` (itself included) whose type is exactly one of ``kinds``, in
    ``ast.walk`` order within each kind. ``tree`` must not be changed afterwards."""
    index = getattr(tree, _ATTRIBUTE, None)
    if index is None:
        index = _walk(tree)
        setattr(tree, _ATTRIBUTE, index)
    return [node for kind in kinds for node in index.get(kind, ())]


def _walk(tree: ast.AST) -> dict[type, list[ast.AST]]:
    """The nodes of ``tree`` by type, in ``ast.walk`` order (breadth first, fields in order),
    without its two generators per node (half the time on a big file)."""
    index: dict[type, list[ast.AST]] = defaultdict(list)
    todo = deque([tree])
    pop, push, node_type = todo.popleft, todo.append, ast.AST
    while todo:
        node = pop()
        index[type(node)].append(node)
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, node_type):
                push(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, node_type):
                        push(item)
    return index
