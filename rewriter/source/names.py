"""Qualified names of candidate nodes without libcst's whole-module scope analysis.

libcst's ``ScopeProvider`` (and the ``ExpressionContextProvider`` it needs) traverses every node of
the mini module twice; on a site-dense file that was a third of the engine's time. The transformer
only asks it one question for almost every node, "which qualified names does this ``Name`` /
``Attribute`` have?", and the answer is decided by the imports and bindings of the node's root
name alone. :class:`Names` answers it from ``ast`` facts (the header's imports, and every binding
in the file: a superset of the mini module's, so a name bound anywhere else counts as "varies")
where the answer is provably libcst's, and says "unknown" (None) otherwise; the transformer then
runs the real scope analysis, once, on demand.

Why the answers are libcst's (``Scope.get_qualified_names_for``, ``ImportAssignment`` and
``Assignment.get_qualified_names_for``, the access inference of ``ScopeVisitor``):

* Every qualified name libcst gives a node with full name ``F`` is ``F`` or ``<scope prefix>.F``
  (a local binding), ``builtins.<root>`` (a builtin), or an import's name: the imported path with
  the part of ``F`` after the import's bound name appended (so it ends with ``F``'s last
  component), or the imported path itself when ``F`` *is* a name bound by an import. A node whose
  last component is no source's last component has a source among them only when some import
  binds ``F`` itself to that source (no source starts with ``builtins.``); otherwise **no match**
  (``_flash_attention_forward`` imported from a model library, next to methods of that name).
* When no import anywhere binds the root of ``F``, only local and builtin names remain: no source
  equal to ``F`` or ending in ``.F`` means **no match**.
* When every binding of the root in the mini module is an import at module level in the header
  (which precedes every chunk, so libcst's "assigned before the access" filter keeps all of them),
  with no ``global``/``nonlocal``/``del`` of it, every scope resolves it to those imports: the
  longest dotted prefix ``P`` of ``F`` an import binds decides, and the names are those the
  imports binding ``P`` give ``F`` -- libcst's access node (``P``'s node) and its prefix search
  over ``F`` land on the same assignments. Without such a prefix the root is a builtin or unbound.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
from collections import defaultdict
from collections.abc import Iterable

import libcst as cst
from libcst.helpers import get_full_name_for_node

from flashport.rewriter.source import astindex, semantic


@dataclasses.dataclass
class _Import:
    """One import statement as libcst's ``ImportAssignment`` sees it."""

    module: str  # "" for ``import x``; dots first for a relative import
    aliases: tuple[tuple[str, str | None], ...]  # (dotted name, asname)


def _bound_names(dotted: str, asname: str | None) -> list[str]:
    """The names libcst records for one import alias: the ``as`` name, or every dotted prefix."""
    if asname is not None:
        return [asname]
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _import_qualified(statement: _Import, full_name: str) -> set[str]:
    """``ImportAssignment.get_qualified_names_for(full_name)``, over an ``ast`` import."""
    results = set()
    for dotted, asname in statement.aliases:
        parts = dotted.split(".")
        for real_name in [".".join(parts[:i]) for i in range(len(parts), 0, -1)]:
            as_name = real_name
            if statement.module.endswith("."):
                real_name = f"{statement.module}{real_name}"
            elif statement.module:
                real_name = f"{statement.module}.{real_name}"
            if asname is not None:
                as_name = asname
            if full_name.startswith(as_name):
                remaining = full_name.split(as_name, 1)[1]
                if remaining and not remaining.startswith("."):
                    continue
                remaining = remaining.lstrip(".")
                results.add(f"{real_name}.{remaining}" if remaining else real_name)
                break
    return results


def binding_qualified(binding: semantic.ImportBinding, full_name: str) -> set[str]:
    """The qualified names one import alias gives the dotted name ``full_name`` (libcst's
    ``ImportAssignment.get_qualified_names_for``, that alias alone)."""
    return _import_qualified(_Import(binding.base, ((binding.alias.name, binding.asname),)), full_name)


def narrowed(names: set[str], reaching: tuple[object, ...] | None, full_name: str) -> set[str]:
    """``names`` (a node's qualified names, blind to the flow) less those no binding in
    ``reaching`` gives it (:meth:`~flashport.rewriter.source.semantic.SemanticModel.reaching` of its
    first name; None: the flow does not decide, ``names`` as they are). Only an import gives a
    qualified name a rule's source can be."""
    if reaching is None:
        return names
    given: set[str] = set()
    for binding in reaching:
        if isinstance(binding, semantic.ImportBinding):
            given |= binding_qualified(binding, full_name)
    return names & given


class Names:
    """Qualified names of ``Name``/``Attribute`` nodes of one mini module, where provable.

    Args:
      tree: the file's ``ast`` (every statement of the mini module is one of its statements).
      header: the mini module's header statements (module level, before every chunk).
      wrappers: the stand-in class names the mini module defines.
      sources: every selected rule's ``SOURCES``.
    """

    def __init__(
        self,
        tree: ast.Module,
        header: Iterable[ast.stmt],
        wrappers: Iterable[str],
        sources: Iterable[str],
    ):
        self._sources = frozenset(sources)
        self._lasts = frozenset(s.rsplit(".", 1)[-1] for s in self._sources)
        self._enabled = not any(s.startswith("builtins.") for s in self._sources)
        self._header_imports: dict[str, list[_Import]] = defaultdict(list)  # bound name -> statements
        self._import_bound: set[str] = set()  # every name any import binds (dotted prefixes too)
        self._source_bound: set[str] = set()  # names an import binds to a source itself
        self._other: set[str] = set(wrappers)  # roots with any binding that is not a header import
        header_ids = {id(statement) for statement in header}
        statements: dict[int, list[semantic.ImportBinding]] = {}
        for binding in semantic.of(tree).imports:
            statements.setdefault(id(binding.node), []).append(binding)
        for bindings in statements.values():
            first = bindings[0]  # every alias of a statement shares its place
            self._import(bindings, not first.scopes and id(first.top) in header_ids)
        self._bindings(tree)

    def _bindings(self, tree: ast.Module) -> None:
        """Every name the file binds other than by an import (assignment and loop targets, ``del``,
        parameters, definitions, ``global``/``nonlocal``, ``except ... as``, match captures)."""
        other = self._other
        other.update(n.id for n in astindex.of_type(tree, ast.Name) if not isinstance(n.ctx, ast.Load))  # type: ignore[attr-defined]
        other.update(n.arg for n in astindex.of_type(tree, ast.arg))  # type: ignore[attr-defined]
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        other.update(n.name for n in astindex.of_type(tree, *kinds))  # type: ignore[attr-defined]
        for node in astindex.of_type(tree, ast.Global, ast.Nonlocal):
            other.update(node.names)  # type: ignore[attr-defined]
        for node in astindex.of_type(tree, ast.ExceptHandler, ast.MatchAs, ast.MatchStar):
            if node.name:  # type: ignore[attr-defined]
                other.add(node.name)  # type: ignore[attr-defined]
        other.update(n.rest for n in astindex.of_type(tree, ast.MatchMapping) if n.rest)  # type: ignore[attr-defined]

    def _import(self, bindings: list[semantic.ImportBinding], in_header_scope: bool) -> None:
        """Note the names one import statement (``bindings``: its aliases) binds."""
        aliases = tuple((b.alias.name, b.asname) for b in bindings if not b.star)
        statement = _Import(bindings[0].base, aliases)
        for dotted, asname in aliases:
            for name in _bound_names(dotted, asname):
                self._import_bound.add(name)
                if _import_qualified(statement, name) & self._sources:
                    self._source_bound.add(name)
                if in_header_scope:
                    self._header_imports[name].append(statement)
                else:
                    self._other.add(name.split(".")[0])

    def qualified(self, node: cst.CSTNode) -> set[str] | None:
        """libcst's qualified names of ``node`` (a ``Name`` or ``Attribute`` in a chunk) as far as
        the rules' ``SOURCES`` can tell them apart: the exact set, or an empty set when none of
        them can be a source; None when only the scope analysis can tell."""
        if not self._enabled:
            return None
        if isinstance(node, cst.Name):
            last = node.value
        elif isinstance(node, cst.Attribute):
            last = node.attr.value
        else:
            return None
        full_name = get_full_name_for_node(node)
        if full_name is None:
            return None
        if last not in self._lasts and full_name not in self._source_bound:
            return set()
        root = full_name.split(".", 1)[0]
        if root not in self._import_bound and not any(
            s == full_name or s.endswith("." + full_name) for s in self._sources
        ):
            return set()
        if root in self._other:
            return None
        prefix: str | None = full_name
        while prefix and prefix not in self._header_imports:
            cut = prefix.rfind(".")
            prefix = None if cut == -1 else prefix[:cut]
        if prefix is None:
            return {f"builtins.{root}"} if hasattr(builtins, root) else set()
        names: set[str] = set()
        for statement in self._header_imports[prefix]:
            names |= _import_qualified(statement, full_name)
        return names
