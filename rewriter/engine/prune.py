"""Cheap, conservative chunk pruning with Python's ``ast`` before the libcst pass.

The engine's chunks are the statements whose *text* mentions a trigger. Most of them, in a real
tree, mention it only in a name that can never resolve to a source API (``self._flash_attn_uses_
top_left_mask``, ``is_flash_attn_2_available()``, ``def _flash_attention_forward``). libcst's scope
and qualified-name analysis over those chunks is where nearly all the time went; this module proves,
with ``ast`` alone, which chunks can hold no site, so the engine can leave them out of the mini
module.

A node can only become a site when libcst's ``QualifiedNameProvider`` resolves it to one of the
rules' ``SOURCES``, or when it is a string literal whose value is one of their ``STRINGS``. Every
qualified name libcst gives a ``Name``/``Attribute`` ends with the node's last attribute, the name
itself, or the imported name behind an ``import ... as alias``; so a *candidate* is:

* an ``Attribute`` whose ``attr`` is the last component of a source;
* a ``Name`` equal to such a last component, or bound anywhere in the file by ``import x as name``
  / ``from m import x as name`` where ``x``'s last component is one;
* a ``str`` constant containing a watched string (implicit concatenation and f-strings are parts
  of one ``ast`` constant, so a substring test keeps them).

Pruning keeps the results identical to parsing every chunk:

* A chunk with a candidate is kept.
* A chunk that binds, at module or class level (or through ``global``), the root name of a
  candidate is kept: the candidate's qualified names depend on every binding of its root.
* When a candidate sits outside any function, every chunk is kept: rules that look at "the
  enclosing function" (result usage, later subscripts, cache reuse) then analyse the whole mini
  module, other chunks included.
* Nodes that are deep-equal to a candidate call share its function name, so they are candidates
  too and stay (rules that tell identical calls apart by order see the same set).
* A rule that reads the module itself (``ctx.module``, or the module as its last ancestor) in a
  pass over pruned chunks makes the engine redo the pass over every chunk: the read is watched
  (:class:`~flashport.rewriter.engine.thin.Watched`), so what rules read is never assumed here.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable, Sequence

from flashport.rewriter.source import semantic

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclasses.dataclass(frozen=True)
class Watch:
    """What the enabled rules can match, reduced to what ``ast`` can test.

    Attributes:
      lasts: last dotted components of every rule's ``SOURCES``.
      strings: every rule's ``STRINGS``.
    """

    lasts: frozenset[str]
    strings: tuple[str, ...]


def watch_of(rules: Iterable) -> Watch:
    """The :class:`Watch` of rule classes or instances."""
    rules = list(rules)
    lasts = frozenset(name.rsplit(".", 1)[-1] for rule in rules for name in rule.SOURCES)
    strings = tuple(sorted({value for rule in rules for value in rule.STRINGS}))
    return Watch(lasts, strings)


def import_aliases(tree: ast.Module, watch: Watch) -> frozenset[str]:
    """Names bound anywhere in ``tree`` by an ``as`` import of a watched last component."""
    return frozenset(
        b.asname
        for b in semantic.of(tree).imports
        if b.asname and b.alias.name.rsplit(".", 1)[-1] in watch.lasts
    )


def _root(node: ast.AST) -> str | None:
    """First component of libcst's ``get_full_name_for_node`` for ``node`` (None if it has none)."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return None


@dataclasses.dataclass
class ChunkInfo:
    """What :func:`analyse` found in one chunk.

    Attributes:
      candidate: it holds a node that may become a site.
      outside_function: one of those candidates is not inside a ``def``.
      roots: root names of its name candidates.
      binds: names it binds at module/class level (or declares ``global``).
    """

    candidate: bool = False
    outside_function: bool = False
    roots: set[str] = dataclasses.field(default_factory=set)
    binds: set[str] = dataclasses.field(default_factory=set)


def analyse(nodes: Sequence[ast.stmt], watch: Watch, aliases: frozenset[str]) -> ChunkInfo:
    """Candidates and bindings of one chunk's statements."""
    info = ChunkInfo()
    names = watch.lasts | aliases
    # (node, syntactically inside a def, runs in the chunk's own scope)
    stack: list[tuple[ast.AST, bool, bool]] = [(node, False, True) for node in nodes]
    while stack:
        node, in_def, level = stack.pop()
        hit = False
        if isinstance(node, ast.Attribute):
            if node.attr in watch.lasts:
                hit = True
                root = _root(node)
                if root is not None:
                    info.roots.add(root)
        elif isinstance(node, ast.Name):
            if node.id in names:
                hit = True
                info.roots.add(node.id)
            if level and not isinstance(node.ctx, ast.Load):
                info.binds.add(node.id)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, str) and any(s in node.value for s in watch.strings):
                hit = True
        elif isinstance(node, ast.Global):
            info.binds.update(node.names)
        elif level:
            _bindings(node, info.binds)
        if hit:
            info.candidate = True
            info.outside_function = info.outside_function or not in_def
        inner = _new_scope(node)
        child_in_def = in_def or isinstance(node, _FUNCTIONS)
        for child in _children(node):
            stack.append((child, child_in_def, level and id(child) not in inner))
    return info


def _children(node: ast.AST) -> list[ast.AST]:
    """``ast.iter_child_nodes(node)`` as a list, without its generators (the walk's main cost)."""
    out: list[ast.AST] = []
    for name in node._fields:
        value = getattr(node, name, None)
        if isinstance(value, ast.AST):
            out.append(value)
        elif isinstance(value, list):
            out.extend(item for item in value if isinstance(item, ast.AST))
    return out


def _new_scope(node: ast.AST) -> set[int]:
    """ids of the children of a def/lambda/class that run in its own scope (its body)."""
    if isinstance(node, ast.Lambda):
        return {id(node.body)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {id(stmt) for stmt in node.body}
    return set()


def _bindings(node: ast.AST, out: set[str]) -> None:
    """Names ``node`` itself binds in its scope (besides plain ``Name`` targets)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        out.add(node.name)
    elif semantic.is_import(node):
        out.update(semantic.import_names(node))
    elif isinstance(node, ast.ExceptHandler) and node.name:
        out.add(node.name)
    elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
        out.add(node.name)
    elif isinstance(node, ast.MatchMapping) and node.rest:
        out.add(node.rest)


def keep(chunk_nodes: Sequence[Sequence[ast.stmt]], tree: ast.Module, watch: Watch) -> list[bool]:
    """For each chunk (its statements), whether the libcst pass must see it (see the module doc)."""
    aliases = import_aliases(tree, watch)
    infos = [analyse(nodes, watch, aliases) for nodes in chunk_nodes]
    if any(info.outside_function for info in infos):
        return [True] * len(infos)
    roots = set().union(*(info.roots for info in infos)) if infos else set()
    return [info.candidate or bool(info.binds & roots) for info in infos]


def may_hold_site(nodes: Sequence[ast.AST], watch: Watch, aliases: frozenset[str]) -> bool:
    """Whether ``nodes`` (any ``ast`` nodes) hold a candidate (see the module doc): a site can
    only sit where there is one."""
    return analyse(nodes, watch, aliases).candidate  # type: ignore[arg-type]
