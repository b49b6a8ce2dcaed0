"""One semantic model per file: what each name of the file's ``ast`` is bound to.

Built once per parsed file (:func:`of` keeps it on the tree object, like
:mod:`~flashport.rewriter.source.astindex`) and asked by the engine, the chunk pruning, the run
context and, through :class:`~flashport.rules.site.RuleContext`, the rules:

* :attr:`SemanticModel.imports`: every name an import binds, with its scope chain and the
  qualified name it binds (``import a.b`` binds ``a`` to ``a``; ``import a.b as c`` binds ``c``
  to ``a.b``; ``from m import x as y`` binds ``y`` to ``m.x``);
* :meth:`SemanticModel.bindings` / :meth:`SemanticModel.binding`: the imports, assignments and
  definitions of a scope;
* :meth:`SemanticModel.resolve` (file-wide import table) and :meth:`SemanticModel.qualified_name_at`
  (the unambiguous imports visible at a line): "what does this name resolve to";
* :meth:`SemanticModel.reaching`: the bindings of a name that may reach one read of it, where the
  flow of its scope decides (a rebinding that dominates the read hides the earlier ones);
* value and attribute aliases (:meth:`SemanticModel.assignments`: ``fn = flash_attn.flash_attn_func``,
  ``self.fn = flash_attn_func``), :meth:`SemanticModel.module_constant`, :attr:`SemanticModel.exports`
  (``__all__``), :meth:`SemanticModel.parent` and :meth:`SemanticModel.enclosing`;
* the libcst pass's questions, with libcst's answers (the engine's speed layer in front of libcst's
  scope analysis, which the reference mode asks alone): :meth:`SemanticModel.header_names` gives
  the qualified names of a mini module's reads and whether a read's bindings are all imports, where
  the header's imports decide them and, for reads in a function's own scope or at module level,
  where the function's and the module's imports, ``=`` targets and definitions do
  (:meth:`HeaderNames.qualified_at`); :meth:`SemanticModel.local_alias` says whether a function-local
  ``name = <value>`` is its function's only binding of the name, and which reads resolve to it;
* mentions: :meth:`SemanticModel.first_comparison` and :meth:`SemanticModel.mentions` (names,
  attribute names and identifier strings per line), what a rule's per-file phase looks for.

Everything is computed on first use and kept: a file whose engine run asks nothing pays nothing. The
statement walk visits statements only (imports and assignments are statements), in ``ast.walk``'s
order, so "the last import wins" reads as it did over ``ast.walk``. This module and the import edits
(:mod:`flashport.rewriter.imports`) are the only code that reads ``ast.Import``/``ast.ImportFrom``
(``tests/test_semantic_model.py`` checks it).
"""

from __future__ import annotations

import ast
import bisect
import builtins
import collections
import dataclasses
import re
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator

from flashport.rewriter.source import astindex

_ATTRIBUTE = "_flashport_semantic"
_IMPORTS = (ast.Import, ast.ImportFrom)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
# Statements whose bodies run in the module's own scope for :meth:`SemanticModel.module_scope`.
_MODULE_BLOCKS = (ast.If, ast.With, ast.Try)


def is_import(node: object) -> bool:
    """Whether ``node`` is an ``import``/``from ... import`` statement."""
    return isinstance(node, _IMPORTS)


def import_names(node: ast.AST) -> list[str]:
    """The names an import statement binds (``import a.b`` binds ``a``; ``"*"`` for a star
    import); empty for any other node."""
    if isinstance(node, ast.Import):
        return [alias.asname or alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [alias.asname or alias.name for alias in node.names]
    return []


def is_none(node: ast.AST | None) -> bool:
    """Whether ``node`` is the literal ``None``."""
    return isinstance(node, ast.Constant) and node.value is None


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain; ``""`` for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(node.id)
    return ".".join(reversed(parts))


def attribute_path(node: ast.AST) -> str:
    """Like :func:`dotted`, but an attribute chain on anything else keeps its attributes with an
    empty root (``f().fn`` -> ``".fn"``): what text searches for a trigger name look at."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "")
    return ".".join(reversed(parts))


@dataclasses.dataclass(frozen=True)
class ImportBinding:
    """One name bound by one alias of an import statement.

    Attributes:
      name: the bound name (``"*"`` for a star import).
      qualified: what it is bound to (``a.b`` for ``import a.b as c``, ``a`` for ``import a.b``,
        ``m.x`` for ``from m import x``; a relative import keeps its dots: ``.m.x``).
      imported: the imported path as written, module and name (``a.b``; ``m.x``; ``.x`` for
        ``from . import x``): what text searches look at.
      asname: the alias's ``as`` name, or None.
      node: the import statement; ``alias``: its alias.
      top: the module-level statement holding it.
      scopes: the defs, lambdas and classes around it, outermost first (empty at module level).
      module_scope: it runs in the module's scope through ``if``/``with``/``try`` blocks only.
    """

    name: str
    qualified: str
    imported: str
    asname: str | None
    node: ast.Import | ast.ImportFrom
    alias: ast.alias
    top: ast.stmt
    scopes: tuple[ast.AST, ...]
    module_scope: bool

    @property
    def relative(self) -> bool:
        """``from . import x`` / ``from .m import x``, or a ``from`` import without a module."""
        return isinstance(self.node, ast.ImportFrom) and bool(self.node.level or not self.node.module)

    @property
    def is_from(self) -> bool:
        """A ``from ... import`` (relative ones too)."""
        return isinstance(self.node, ast.ImportFrom)

    @property
    def base(self) -> str:
        """The module of a ``from`` import with its leading dots (``..m``); ``""`` for ``import``."""
        if isinstance(self.node, ast.ImportFrom):
            return "." * self.node.level + (self.node.module or "")
        return ""

    @property
    def from_module(self) -> str:
        """The module of a ``from`` import as written, without its dots (``""`` for ``import``)."""
        return (self.node.module or "") if isinstance(self.node, ast.ImportFrom) else ""

    @property
    def star(self) -> bool:
        """``from m import *``."""
        return self.alias.name == "*"


@dataclasses.dataclass(frozen=True)
class Binding:
    """A name bound in a scope other than by an import: ``kind`` is ``"assign"`` (a plain ``Name``
    target of ``=``), ``"def"`` or ``"class"``; ``node`` the statement."""

    name: str
    kind: str
    node: ast.stmt


@dataclasses.dataclass(frozen=True)
class Assignment:
    """An ``=`` whose value is a Name/Attribute chain: a value alias (``fn = flash_attn_func``) or
    an attribute alias (``self.fn = flash_attn_func``).

    Attributes:
      node: the ``ast.Assign``.
      names: its plain ``Name`` targets; ``attributes``: the last names of its ``Attribute`` targets.
      value: :func:`attribute_path` of the value.
    """

    node: ast.Assign
    names: tuple[str, ...]
    attributes: tuple[str, ...]
    value: str


@dataclasses.dataclass(frozen=True)
class LocalAlias:
    """What libcst's scope analysis says of a function-local alias (:meth:`SemanticModel.local_alias`).

    Attributes:
      uses: how many reads it records as the alias's references.
      references: the file lines of those reads; ``others``: of the function's reads of the name
        that resolve elsewhere (before the statement).
      lines: the function's first and last line.
    """

    uses: int
    references: frozenset[int]
    others: frozenset[int]
    lines: tuple[int, int]

    def resolves(self, line: int) -> bool | None:
        """Whether the read of the alias's name on file line ``line`` resolves to the alias (None:
        the line holds reads of both kinds)."""
        if not self.lines[0] <= line <= self.lines[1]:
            return False
        if line in self.references:
            return None if line in self.others else True
        return False


class SemanticModel:
    """The bindings of one parsed file (see the module docstring). Do not change the tree after
    building it."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self._imports: list[ImportBinding] | None = None
        self._scoped: dict[int, list[Binding]] | None = None
        self._parents: dict[int, ast.AST] | None = None
        self._import_table: dict[str, str] | None = None
        self._at: dict[int, dict[str, str]] = {}
        self._stored: frozenset[str] | None = None
        self._functions: list[ast.AST] | None = None
        self._assignments: list[Assignment] | None = None
        self._reaching: dict[tuple[str, int], tuple[ImportBinding | ast.AST, ...] | None] = {}
        self._declared: frozenset[str] | None = None
        self._block_starts: dict[int, list[int]] = {}
        self._counts: collections.Counter | None = None
        self._locals: dict[tuple[int, str], bool] = {}
        self._comprehension_targets: frozenset[str] | None = None

    # -- the statement walk ------------------------------------------------------------------------

    def _walk(self) -> None:
        """Visit every statement once, in ``ast.walk`` order, noting imports and scope bindings."""
        imports: list[ImportBinding] = []
        scoped: dict[int, list[Binding]] = {}
        module = self.tree
        # (node, top-level statement, scopes around it, in the module's scope)
        todo: deque[tuple[ast.AST, ast.stmt | None, tuple[ast.AST, ...], bool]] = deque(
            [(module, None, (), True)]
        )
        while todo:
            node, top, scopes, in_module = todo.popleft()
            owner = scopes[-1] if scopes else module
            if isinstance(node, _IMPORTS):
                for alias in node.names:
                    imports.append(_import_binding(node, alias, top, scopes, in_module))  # type: ignore[arg-type]
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        scoped.setdefault(id(owner), []).append(Binding(target.id, "assign", node))
            elif isinstance(node, (*_DEFS, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                scoped.setdefault(id(owner), []).append(Binding(node.name, kind, node))
            inner = (*scopes, node) if isinstance(node, SCOPES) else scopes
            keeps_module = node is module or (
                in_module and isinstance(node, (*_MODULE_BLOCKS, ast.ExceptHandler))
            )
            for field in node._fields:
                value = getattr(node, field, None)
                if not isinstance(value, list):
                    continue
                for item in value:
                    if isinstance(item, (ast.stmt, ast.ExceptHandler, ast.match_case)):
                        todo.append((item, top if top is not None else item, inner, keeps_module))  # type: ignore[arg-type]
        self._imports, self._scoped = imports, scoped

    @property
    def imports(self) -> list[ImportBinding]:
        """Every name bound by an import anywhere in the file, in ``ast.walk`` order."""
        if self._imports is None:
            self._walk()
        return self._imports  # type: ignore[return-value]

    def import_statements(self) -> list[ast.Import | ast.ImportFrom]:
        """Every import statement of the file, once each, in ``ast.walk`` order."""
        return list({id(b.node): b.node for b in self.imports}.values())

    def bindings(self, scope: ast.AST | None = None) -> list[Binding]:
        """The assignments and definitions of ``scope`` (a def, lambda or class; None: the module)
        other than imports (those: :attr:`imports`, by their ``scopes``)."""
        if self._scoped is None:
            self._walk()
        return list(self._scoped.get(id(scope if scope is not None else self.tree), ()))  # type: ignore[union-attr]

    def binding(self, name: str, scope: ast.AST | None = None) -> list[ImportBinding | Binding]:
        """Every binding of ``name`` made directly in ``scope`` (None: the module), imports first."""
        found: list[ImportBinding | Binding] = [
            b for b in self.imports if b.name == name and (b.scopes[-1] if b.scopes else None) is scope
        ]
        return found + [b for b in self.bindings(scope) if b.name == name]

    # -- what a name resolves to -------------------------------------------------------------------

    def import_table(self) -> dict[str, str]:
        """Bound name -> qualified name, over every absolute import anywhere in the file (the last
        one in ``ast.walk`` order wins): a file-wide reading, blind to scopes."""
        if self._import_table is None:
            self._import_table = {b.name: b.qualified for b in self.imports if not b.relative}
        return self._import_table

    def resolve(self, node: ast.AST) -> str:
        """The dotted name ``node`` refers to, its first part resolved through :meth:`import_table`
        (unchanged when that part is not imported; ``""`` when ``node`` is no Name/Attribute chain)."""
        text = dotted(node)
        head, _, rest = text.partition(".")
        table = self.import_table()
        if head in table:
            return table[head] + (f".{rest}" if rest else "")
        return text

    def imports_at(self, line: int) -> dict[str, str]:
        """The imports a name read at ``line`` provably resolves through: bound name -> qualified
        name, from the module's scope (:meth:`module_scope`) and the innermost ``def`` around
        ``line``. Left out: relative imports, imports before the file's last star import (it may
        rebind any name), and names imported as two different things or also assigned anywhere."""
        if line in self._at:
            return self._at[line]
        inner = self.function_at(line)
        around = self._enclosing_defs(line)
        found: dict[str, set[str]] = {}
        last_star = max(self.star_import_lines(), default=0)
        for b in self.imports:
            visible = b.module_scope or (inner is not None and any(s is inner for s in b.scopes))
            if not visible and b.scopes and any(b.scopes[-1] is f for f in around):
                # an import in an enclosing def: Python's closures see it, unless a def between
                # takes a parameter of that name
                deeper = [f for f in around if f.lineno > b.scopes[-1].lineno]  # type: ignore[attr-defined]
                visible = not any(a.arg == b.name for f in deeper for a in _arguments(f.args))  # type: ignore[attr-defined]
            if not visible:
                continue
            if b.relative or b.node.lineno < last_star:
                continue
            found.setdefault(b.name, set()).add(b.qualified)
        stored = self.stored_names()
        table = {name: next(iter(t)) for name, t in found.items() if len(t) == 1 and name not in stored}
        self._at[line] = table
        return table

    def qualified_name_at(self, text: str, line: int) -> str:
        """The qualified name of the dotted name ``text`` read at ``line``, through
        :meth:`imports_at`; ``""`` when its first name is not such an import."""
        head, _, rest = text.partition(".")
        table = self.imports_at(line)
        if not text or head not in table:
            return ""
        return table[head] + (f".{rest}" if rest else "")

    def qualified_names(self, node: ast.AST) -> set[str]:
        """The qualified names of an ``ast`` Name/Attribute chain (:meth:`qualified_name_at` at its
        line); empty when it resolves to no import."""
        name = self.qualified_name_at(dotted(node), getattr(node, "lineno", 0))
        return {name} if name else set()

    def star_import_lines(self) -> list[int]:
        """Lines of the module-scope ``from m import *`` statements."""
        return sorted({b.node.lineno for b in self.imports if b.star and b.module_scope})

    def stored_names(self) -> frozenset[str]:
        """Every name the file assigns or deletes anywhere (``Name`` targets)."""
        if self._stored is None:
            names = astindex.of_type(self.tree, ast.Name)
            self._stored = frozenset(n.id for n in names if not isinstance(n.ctx, ast.Load))  # type: ignore[attr-defined]
        return self._stored

    def loads(self, name: str) -> list[ast.Name]:
        """Every read of ``name`` (``Name`` nodes in ``Load`` context) in the file."""
        nodes = astindex.of_type(self.tree, ast.Name)
        return [n for n in nodes if n.id == name and isinstance(n.ctx, ast.Load)]  # type: ignore[attr-defined,misc]

    # -- aliases, constants, exports ---------------------------------------------------------------

    def assignments(self) -> list[Assignment]:
        """Every ``=`` anywhere whose value is a Name/Attribute chain, in ``ast.walk`` order."""
        if self._assignments is None:
            self._assignments = [
                Assignment(
                    node,  # type: ignore[arg-type]
                    tuple(t.id for t in node.targets if isinstance(t, ast.Name)),  # type: ignore[attr-defined]
                    tuple(t.attr for t in node.targets if isinstance(t, ast.Attribute)),  # type: ignore[attr-defined]
                    attribute_path(node.value),  # type: ignore[attr-defined]
                )
                for node in astindex.of_type(self.tree, ast.Assign)
                if isinstance(node.value, (ast.Name, ast.Attribute))  # type: ignore[attr-defined]
            ]
        return self._assignments

    def value_aliases(self, statements: Iterable[ast.stmt]) -> list[tuple[str, str]]:
        """``(name, value)`` of the ``name = <Name/Attribute chain>`` among ``statements`` (one
        plain target): local aliases of whatever the value names."""
        return [
            (stmt.targets[0].id, attribute_path(stmt.value))
            for stmt in statements
            if isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, (ast.Name, ast.Attribute))
        ]

    def module_scope(self) -> Iterable[ast.stmt]:
        """The statements that run in the module's own scope: top level and inside module-level
        ``if``/``try``/``with`` blocks (not in loops, functions or classes), in source order."""
        pending: list[ast.stmt] = list(self.tree.body)
        while pending:
            statement = pending.pop(0)
            yield statement
            if isinstance(statement, (ast.If, ast.With)):
                pending.extend(statement.body)
                pending.extend(getattr(statement, "orelse", []))
            elif isinstance(statement, ast.Try):
                pending.extend(statement.body + statement.orelse + statement.finalbody)
                for handler in statement.handlers:
                    pending.extend(handler.body)

    def module_constant(self, name: str) -> ast.expr | None:
        """The value of ``name`` when the file binds it exactly once anywhere, by ``name = value``
        in the module's scope (:meth:`module_scope`), with no star import after it; else None. Its
        reads (:meth:`loads`) are the caller's to judge: a mutation through one is not seen here."""
        binding: ast.Assign | None = None
        for statement in self.module_scope():
            if (
                isinstance(statement, ast.Assign)
                and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)
                and statement.targets[0].id == name
            ):
                binding = statement
        if binding is None or max(self.star_import_lines(), default=0) > binding.lineno:
            return None
        stores = 0
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and node.id == name:
                stores += not isinstance(node.ctx, ast.Load)
            elif _binds(node, name):
                return None
        return binding.value if stores == 1 else None

    def local_value(self, name: str, line: int) -> tuple[ast.expr, ast.AST] | None:
        """``(value, def)`` when a read of ``name`` at ``line`` resolves to a variable of an
        enclosing ``def`` (the innermost that binds it) that binds it exactly once, by ``name =
        value``, with no ``global``/``nonlocal`` of it there and no parameter of that name on the
        way; else None. Its reads are the caller's to judge (a mutation through one is not seen)."""
        if self.star_import_lines():
            return None
        for function in reversed(self._enclosing_defs(line)):
            if any(a.arg == name for a in _arguments(function.args)):  # type: ignore[attr-defined]
                return None
            found = [b for statement in function.body for b in _binders(statement, name)]  # type: ignore[attr-defined]
            if any(isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names for n in ast.walk(function)):
                return None
            if not found:
                continue
            parent = self.parent(found[0]) if len(found) == 1 else None
            if isinstance(parent, ast.Assign) and parent.targets == [found[0]]:
                return parent.value, function
            return None
        return None

    @property
    def exports(self) -> tuple[str, ...] | None:
        """The names of a module-scope ``__all__ = [...]``/``(...)`` of string literals (the last
        such assignment), or None when the file has none or it is not that plain."""
        value = None
        for statement in self.module_scope():
            if isinstance(statement, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in statement.targets
            ):
                value = statement.value
        if isinstance(value, (ast.List, ast.Tuple)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
        ):
            return tuple(e.value for e in value.elts)  # type: ignore[attr-defined]
        return None

    # -- mentions ----------------------------------------------------------------------------------

    def first_comparison(self, names: Iterable[str]) -> int | None:
        """The line of the first comparison (``ast.walk`` order) with a plain read of one of
        ``names`` as a side (``type(m) is RotaryEmbedding``); None when there is none."""
        wanted = set(names)
        for node in astindex.of_type(self.tree, ast.Compare):
            sides = (node.left, *node.comparators)  # type: ignore[attr-defined]
            if any(isinstance(side, ast.Name) and side.id in wanted for side in sides):
                return node.lineno  # type: ignore[attr-defined]
        return None

    def mentions(self, matches: Callable[[str], bool]) -> collections.Counter:
        """Line -> how many mentions there ``matches`` accepts: a ``Name`` (read or written), an
        attribute's name (``m.name``) or an identifier-like string constant (``getattr(m, "name")``;
        a docstring is no identifier). An import statement's names are not mentions."""
        uses: collections.Counter = collections.Counter()
        for node in astindex.of_type(self.tree, ast.Name, ast.Attribute, ast.Constant):
            if isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                text = node.value
            else:
                continue
            if matches(text):
                uses[node.lineno] += 1
        return uses

    # -- structure ---------------------------------------------------------------------------------

    def parent(self, node: ast.AST) -> ast.AST | None:
        """The node that holds ``node`` (None for the module or a node of another tree)."""
        if self._parents is None:
            self._parents = {
                id(child): item for item in ast.walk(self.tree) for child in ast.iter_child_nodes(item)
            }
        return self._parents.get(id(node))

    def enclosing(self, node: ast.AST, kind: type | tuple[type, ...] = SCOPES) -> ast.AST | None:
        """The nearest ancestor of ``node`` of type ``kind`` (a def, lambda or class by default)."""
        current = self.parent(node)
        while current is not None and not isinstance(current, kind):
            current = self.parent(current)
        return current

    def _enclosing_defs(self, line: int) -> list[ast.AST]:
        """Every ``def`` whose lines hold ``line``, outermost first."""
        self.function_at(line)
        return [f for f in self._functions or () if f.lineno <= line <= (f.end_lineno or f.lineno)]  # type: ignore[attr-defined]

    def function_at(self, line: int) -> ast.AST | None:
        """The innermost ``def`` whose lines hold ``line`` (the one starting last), or None."""
        if self._functions is None:
            self._functions = astindex.of_type(self.tree, *_DEFS)
            self._functions.sort(key=lambda f: f.lineno)  # type: ignore[attr-defined]
        around = [f for f in self._functions if f.lineno <= line <= (f.end_lineno or f.lineno)]  # type: ignore[attr-defined]
        return max(around, key=lambda f: f.lineno, default=None)  # type: ignore[attr-defined]

    def own_scope_function(self, line: int) -> ast.AST | None:
        """The ``def`` whose own scope holds every read on ``line``: ``line`` lies in its body,
        outside any nested def, lambda, class or comprehension, and only classes enclose the
        ``def`` (no closure); None otherwise."""
        function = self.function_at(line)
        if function is None or line < function.body[0].lineno:  # type: ignore[attr-defined]
            return None  # its decorators, defaults and annotations run in the enclosing scope
        if any(
            isinstance(up, SCOPES) and not isinstance(up, ast.ClassDef) for up in self._ancestors(function)
        ):
            return None
        inner = (*SCOPES, *_COMPREHENSIONS)
        for statement in function.body:  # type: ignore[attr-defined]
            if _spans(statement, line) and any(
                isinstance(node, inner) and _spans(node, line) for node in ast.walk(statement)
            ):
                return None
        return function

    def comprehension_targets(self) -> frozenset[str]:
        """Every name a comprehension's ``for`` binds anywhere in the file."""
        if self._comprehension_targets is None:
            self._comprehension_targets = frozenset(
                n.id
                for c in astindex.of_type(self.tree, ast.comprehension)
                for n in ast.walk(c.target)  # type: ignore[attr-defined]
                if isinstance(n, ast.Name)
            )
        return self._comprehension_targets

    def module_binders(self, name: str, present: Collection[int]) -> list[ast.AST] | None:
        """The module-level bindings of ``name`` other than imports in the top-level statements
        whose ids are in ``present``: ``Name`` targets of ``=`` (annotated ones with a value) and
        ``def``/``class`` statements; None when another kind binds it there (``for``, ``with``,
        ``except ... as``, walrus, ``del``, ``+=``, match captures)."""
        found: list[ast.AST] = []
        for statement in self.tree.body:
            if id(statement) not in present:
                continue
            for binder in _binders(statement, name):
                if isinstance(binder, ast.alias):
                    continue
                if isinstance(binder, (*_DEFS, ast.ClassDef)) or (
                    isinstance(binder, ast.Name)
                    and isinstance(binder.ctx, ast.Store)
                    and self._assigned(binder)
                ):
                    found.append(binder)
                else:
                    return None
        return found

    def _assigned(self, target: ast.Name) -> bool:
        """Whether ``target`` is a target of an ``=`` (in a tuple or list too) or of an annotated
        assignment with a value."""
        node: ast.AST = target
        parent = self.parent(node)
        while isinstance(parent, (ast.Tuple, ast.List, ast.Starred)):
            node, parent = parent, self.parent(parent)
        if isinstance(parent, ast.Assign):
            return any(t is node for t in parent.targets)
        return isinstance(parent, ast.AnnAssign) and parent.target is node and parent.value is not None

    def module_scope_statement(self, line: int) -> ast.stmt | None:
        """The top-level statement holding ``line`` when every read on ``line`` runs in the
        module's own scope: no def, class, lambda or comprehension holds the line; None otherwise."""
        starts = self._starts(self.tree.body)
        index = bisect.bisect_right(starts, line) - 1
        if index < 0 or not _spans(self.tree.body[index], line):
            return None
        statement = self.tree.body[index]
        inner = (*SCOPES, *_COMPREHENSIONS)
        if isinstance(statement, inner):
            return None
        for node in ast.walk(statement):
            if isinstance(node, inner) and _start(node) <= line <= (node.end_lineno or node.lineno):
                return None
        return statement

    def top_statement(self, node: ast.AST) -> ast.AST:
        """The top-level statement holding ``node``."""
        current = node
        while (up := self.parent(current)) is not None and up is not self.tree:
            current = up
        return current

    def local_alias(self, name: str, line: int) -> LocalAlias | None:
        """libcst's view of a function-local alias ``name = <value>`` on file line ``line`` (a
        statement directly in a ``def`` that no other ``def`` encloses): the reads of ``name`` it
        answers for (:class:`LocalAlias`), where the whole function binds ``name`` there alone.
        libcst records as its references the reads in the function's own scope after the
        statement and every read in a scope nested in the function; a read before it resolves
        elsewhere. None where only the scope analysis can tell: ``name`` bound again anywhere in the
        function (a parameter, ``+=``, ``del``, a nested scope's binding), declared
        ``global``/``nonlocal``, in a string (annotations), read on the statement's own lines or
        where libcst's order of evaluation differs from Python's (a nested def's defaults,
        decorators and annotations, a class's bases, a comprehension's first iterable)."""
        function = self.own_scope_function(line)
        if function is None or name in self.declared_names():
            return None
        if any(a.arg == name for a in _arguments(function.args)):  # type: ignore[attr-defined]
            return None
        statement = next((s for s in function.body if _spans(s, line)), None)  # type: ignore[attr-defined]
        if not isinstance(statement, ast.Assign) or statement.lineno != line:
            return None
        body = ast.Module(body=function.body, type_ignores=[])  # type: ignore[attr-defined]
        binders = [node for node in ast.walk(body) if _binds_any(node, name)]
        if len(binders) != 1 or not any(t is binders[0] for t in statement.targets):
            return None
        uses, references, others = 0, set(), set()
        for read, nested in _reads(function, name):
            if read is None or (
                read.lineno <= (statement.end_lineno or line) and not nested and read.lineno >= line
            ):
                return None  # an ambiguous place, or a read on the statement's lines
            if nested or read.lineno > (statement.end_lineno or line):
                uses += 1
                references.add(read.lineno)
            else:
                others.add(read.lineno)
        start, end = _start(function), function.end_lineno or function.lineno  # type: ignore[attr-defined]
        return LocalAlias(uses, frozenset(references), frozenset(others), (start, end))

    def _ancestors(self, node: ast.AST) -> list[ast.AST]:
        """The ancestors of ``node``, nearest first."""
        found = []
        current = self.parent(node)
        while current is not None:
            found.append(current)
            current = self.parent(current)
        return found

    # -- flow: the bindings that reach a read ------------------------------------------------------

    def reaching(self, name: str, line: int) -> tuple[ImportBinding | ast.AST, ...] | None:
        """The bindings of ``name`` that a read of it at ``line`` may see, where the flow of its
        scope decides it; None where it does not (libcst's scope analysis, blind to the flow,
        answers then).

        Walking back from the read's statement through its blocks, the first statement that binds
        ``name`` unconditionally (an import, ``name = ...``, a ``def``/``class`` of it, ``del``, the
        function's parameter) hides every earlier binding; bindings met on the way inside a branch,
        loop, ``try`` or ``with`` (and a loop's or a ``try``'s own bindings where the read is in its
        body, handler or ``else``) may reach it too. An import is answered as its
        :class:`ImportBinding`, any other binding as its ``ast`` node (a ``Name`` target, a
        ``def``/``class``, a ``del``'s name, an ``arg``, an ``except ... as``/match capture).

        None where the flow cannot tell: the read is in a class body, a lambda or a generator
        expression, on a line holding more than one statement or a one-line block's header and
        body, in a ``while`` test, an ``except``/``case`` line or a ``with`` binding ``name``; in a
        function that does not bind ``name`` itself (a global or free variable: any caller may run
        first); anywhere ``name`` is declared ``global``/``nonlocal`` or a star import exists; or
        no unconditional binding precedes the read in its scope.
        """
        key = (name, line)
        if key not in self._reaching:
            self._reaching[key] = self._reaching_at(name, line)
        return self._reaching[key]

    def _reaching_at(self, name: str, line: int) -> tuple[ImportBinding | ast.AST, ...] | None:
        if self._binding_counts()[name] < 2:
            return None  # one binding at most: the flow cannot hide any (a site-dense file's usual case)
        if name in self.declared_names() or self.star_import_lines():
            return None
        located = _path_to(self.tree, line, self._starts)
        if located is None:
            return None
        path, in_header = located
        owner, _, block, index = path[-1]
        point = block[index]
        if _binders(point, name, _header(point) if in_header else None):
            return None  # `fn = wrap(fn)`, a walrus: which binding the read sees depends on the order
        scope_at = max((i for i, step in enumerate(path) if isinstance(step[0], SCOPES)), default=-1)
        if scope_at >= 0:
            scope = path[scope_at][0]
            if not isinstance(scope, _DEFS) or not self._local(scope, name):
                return None  # a class body; a global or free variable of the function
            path = path[scope_at:]
        found: list[ast.AST] = []
        for owner, field, block, index in reversed(path):
            for statement in reversed(block[:index]):
                binders = _binders(statement, name)
                if not binders:
                    continue
                found += binders
                if _binds_unconditionally(statement, name):
                    return self._as_bindings(found)
            if isinstance(owner, _DEFS):  # the function's start: its parameters, or unbound
                parameters: list[ast.AST] = [a for a in _arguments(owner.args) if a.arg == name]
                return self._as_bindings(found + parameters) if parameters else None
            if isinstance(owner, (*_LOOPS, ast.Match)) or (isinstance(owner, _TRY) and field != "body"):
                # a loop's later statements reach its body again; a handler, `else` or `finally`
                # may follow any part of the try; a case's pattern binds
                found += _binders(owner, name)
            else:  # `if (fn := ...):`, `with ... as fn:`
                found += _binders(owner, name, _header(owner))
        return None  # the module's start: unbound, or a builtin

    def _starts(self, block: list) -> list[int]:
        """The first lines of ``block``'s statements (kept per block: a file's reads share them)."""
        key = id(block)
        if key not in self._block_starts:
            self._block_starts[key] = [_start(statement) for statement in block]
        return self._block_starts[key]

    def _local(self, function: ast.AST, name: str) -> bool:
        """:func:`_binds_locally`, kept per function and name."""
        key = (id(function), name)
        if key not in self._locals:
            self._locals[key] = _binds_locally(function, name)
        return self._locals[key]

    def _as_bindings(self, nodes: list[ast.AST]) -> tuple[ImportBinding | ast.AST, ...]:
        """``nodes`` with each import alias as its :class:`ImportBinding`."""
        by_alias = {id(b.alias): b for b in self.imports}
        return tuple(by_alias.get(id(node), node) for node in nodes)

    def _binding_counts(self) -> collections.Counter:
        """How many times the file binds each name anywhere (imports, targets, definitions,
        parameters, ``except ... as``, match captures)."""
        if self._counts is None:
            counts: collections.Counter = collections.Counter(b.name for b in self.imports)
            counts.update(self.stored_names_counted())
            kinds = (
                ast.FunctionDef,
                ast.AsyncFunctionDef,
                ast.ClassDef,
                ast.ExceptHandler,
                ast.MatchAs,
                ast.MatchStar,
            )
            counts.update(getattr(n, "name", None) for n in astindex.of_type(self.tree, *kinds))
            counts.update(n.arg for n in astindex.of_type(self.tree, ast.arg))  # type: ignore[attr-defined]
            counts.update(n.rest for n in astindex.of_type(self.tree, ast.MatchMapping))  # type: ignore[attr-defined]
            self._counts = counts
        return self._counts

    def stored_names_counted(self) -> collections.Counter:
        """How many ``Name`` targets (stores and deletes) of each name the file has."""
        names = astindex.of_type(self.tree, ast.Name)
        return collections.Counter(n.id for n in names if not isinstance(n.ctx, ast.Load))  # type: ignore[attr-defined]

    def bound_otherwise(self) -> frozenset[str]:
        """Every name the file binds anywhere other than by an import (assignment and loop targets,
        ``del``, parameters, definitions, ``except ... as``, match captures) or declares
        ``global``/``nonlocal``."""
        imported = collections.Counter(b.name for b in self.imports)
        counted = self._binding_counts() - imported
        return frozenset(name for name in counted if name) | self.declared_names()

    # -- the libcst pass's names -------------------------------------------------------------------

    def header_names(
        self,
        header: Iterable[ast.stmt],
        wrappers: Iterable[str],
        sources: Iterable[str],
        chunks: Iterable[ast.stmt] = (),
    ) -> HeaderNames:
        """The qualified names of the dotted names read in a mini module of this file (its
        ``header`` statements, then chunks of its statements inside stand-in classes named
        ``wrappers``), where the imports decide them: :class:`HeaderNames`."""
        return HeaderNames(self, header, wrappers, sources, chunks)

    def declared_names(self) -> frozenset[str]:
        """Every name some ``global``/``nonlocal`` statement of the file declares."""
        if self._declared is None:
            self._declared = frozenset(
                n
                for node in astindex.of_type(self.tree, ast.Global, ast.Nonlocal)
                for n in node.names  # type: ignore[attr-defined]
            )
        return self._declared


def of(tree: ast.Module) -> SemanticModel:
    """The :class:`SemanticModel` of ``tree``, built on first use and kept on the tree object."""
    model = getattr(tree, _ATTRIBUTE, None)
    if model is None:
        model = SemanticModel(tree)
        setattr(tree, _ATTRIBUTE, model)
    return model


def _import_qualified(base: str, aliases: Iterable[tuple[str, str | None]], full_name: str) -> set[str]:
    """libcst's ``ImportAssignment.get_qualified_names_for(full_name)`` for an import statement
    whose ``from`` module is ``base`` (``""`` for ``import``; dots first for a relative one) and
    whose aliases are ``(dotted name, asname)``."""
    results = set()
    for name, asname in aliases:
        parts = name.split(".")
        for real_name in [".".join(parts[:i]) for i in range(len(parts), 0, -1)]:
            as_name = real_name
            if base.endswith("."):
                real_name = f"{base}{real_name}"
            elif base:
                real_name = f"{base}.{real_name}"
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


def import_qualified(binding: ImportBinding, full_name: str) -> set[str]:
    """The qualified names one import alias gives the dotted name ``full_name`` (libcst's
    ``ImportAssignment.get_qualified_names_for``, that alias alone)."""
    return _import_qualified(binding.base, ((binding.alias.name, binding.asname),), full_name)


def narrowed(names: set[str], reaching: tuple[object, ...] | None, full_name: str) -> set[str]:
    """``names`` (a read's qualified names, blind to the flow) less those no binding in
    ``reaching`` gives it (:meth:`SemanticModel.reaching` of its first name; None: the flow does
    not decide, ``names`` as they are). Only an import gives a qualified name a rule's source can be."""
    if reaching is None:
        return names
    given: set[str] = set()
    for binding in reaching:
        if isinstance(binding, ImportBinding):
            given |= import_qualified(binding, full_name)
    return names & given


def _bound_names(name: str, asname: str | None) -> list[str]:
    """The names libcst records for one import alias: the ``as`` name, or every dotted prefix."""
    if asname is not None:
        return [asname]
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


class HeaderNames:
    """Qualified names of the dotted names a mini module reads (:meth:`SemanticModel.header_names`),
    as libcst's ``QualifiedNameProvider`` gives them, where the model's imports and bindings prove
    the answer; the engine's scope analysis of the mini module answers the rest (and every
    question in the reference mode).

    Why the answers are libcst's (``Scope.get_qualified_names_for``, ``ImportAssignment`` and
    ``Assignment.get_qualified_names_for``, the access inference of ``ScopeVisitor``):

    * Every qualified name libcst gives a read with full name ``F`` is ``F`` or ``<scope prefix>.F``
      (a local binding), ``builtins.<root>`` (a builtin), or an import's name: the imported path
      with the part of ``F`` after the import's bound name appended (so it ends with ``F``'s last
      component), or the imported path itself when ``F`` *is* a name bound by an import. A read
      whose last component is no source's last component has a source among them only when some
      import binds ``F`` itself to that source (no source starts with ``builtins.``); otherwise
      **no match** (``_flash_attention_forward`` imported from a model library, next to methods of
      that name).
    * When no import anywhere binds the root of ``F``, only local and builtin names remain: no
      source equal to ``F`` or ending in ``.F`` means **no match**.
    * When every binding of the root in the file is an import at module level in the header
      (which precedes every chunk, so libcst's "assigned before the access" filter keeps all of
      them), with no ``global``/``nonlocal``/``del`` of it, every scope resolves it to those
      imports: the longest dotted prefix ``P`` of ``F`` an import binds decides, and the names are
      those the imports binding ``P`` give ``F``. Without such a prefix the root is a builtin or
      unbound. Every binding of the file counts (a superset of the mini module's): a root bound
      anywhere else "varies", and the scope analysis answers.

    Args:
      model: the file's model (every statement of the mini module is one of its statements).
      header: the mini module's header statements (module level, before every chunk).
      wrappers: the stand-in class names the mini module defines.
      sources: every selected rule's ``SOURCES``.
      chunks: the file's statements the mini module holds as chunks (:meth:`qualified_at`).
    """

    def __init__(
        self,
        model: SemanticModel,
        header: Iterable[ast.stmt],
        wrappers: Iterable[str],
        sources: Iterable[str],
        chunks: Iterable[ast.stmt] = (),
    ):
        self._model = model
        self._sources = frozenset(sources)
        self._lasts = frozenset(s.rsplit(".", 1)[-1] for s in self._sources)
        self._enabled = not any(s.startswith("builtins.") for s in self._sources)
        # bound name -> (from module, aliases) of the header imports binding it
        self._header_imports: dict[str, list[tuple[str, tuple[tuple[str, str | None], ...]]]] = (
            collections.defaultdict(list)
        )
        self._import_bound: set[str] = set()  # every name any import binds (dotted prefixes too)
        self._source_bound: set[str] = set()  # names an import binds to a source itself
        self._dotted_roots: set[str] = set()  # roots of the dotted names imports bind (``import a.b``)
        # roots with any binding that is not a header import
        self._other: set[str] = set(wrappers) | model.bound_otherwise()
        header_ids = {id(statement) for statement in header}
        self._present = header_ids | {id(statement) for statement in chunks}  # the mini module's
        self._header_ids = header_ids
        self._wrappers = frozenset(wrappers)
        statements: dict[int, list[ImportBinding]] = {}
        for binding in model.imports:
            statements.setdefault(id(binding.node), []).append(binding)
        for bindings in statements.values():
            first = bindings[0]  # every alias of a statement shares its place
            self._import(bindings, not first.scopes and id(first.top) in header_ids)

    def _import(self, bindings: list[ImportBinding], in_header_scope: bool) -> None:
        """Note the names one import statement (``bindings``: its aliases) binds."""
        statement = (bindings[0].base, tuple((b.alias.name, b.asname) for b in bindings if not b.star))
        for name, asname in statement[1]:
            for bound in _bound_names(name, asname):
                self._import_bound.add(bound)
                if "." in bound:
                    self._dotted_roots.add(bound.split(".", 1)[0])
                if _import_qualified(*statement, bound) & self._sources:
                    self._source_bound.add(bound)
                if in_header_scope:
                    self._header_imports[bound].append(statement)
                else:
                    self._other.add(bound.split(".")[0])

    def imports_only(self, full_name: str) -> bool | None:
        """Whether every binding that libcst's scope analysis resolves a read with full name
        ``full_name`` to is an import: True where every binding of its root in the file is a
        module-level header import binding the root itself (no ``import root.x``, whose dotted
        bindings libcst records apart); None where only the scope analysis can tell."""
        root = full_name.split(".", 1)[0]
        if root in self._other or root in self._dotted_roots or root not in self._header_imports:
            return None
        return True

    def qualified(self, full_name: str) -> set[str] | None:
        """libcst's qualified names of a read in a chunk whose full name (libcst's
        ``get_full_name_for_node``) is ``full_name``, as far as the rules' ``SOURCES`` can tell
        them apart: the exact set, or an empty set when none of them can be a source; None when
        only the scope analysis can tell."""
        if not self._enabled:
            return None
        if full_name.rsplit(".", 1)[-1] not in self._lasts and full_name not in self._source_bound:
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
            names |= _import_qualified(*statement, full_name)
        return names

    def qualified_at(self, full_name: str, line: int) -> set[str] | None:
        """Where :meth:`qualified` cannot tell (a name also bound other than by a header import:
        ``from flash_attn import flash_attn_func`` in a function or a guarded ``try``, a ``None``
        fallback): libcst's names for a read at file line ``line`` in a function's own scope
        (:meth:`SemanticModel.own_scope_function`; no closure) or at module level
        (:meth:`SemanticModel.module_scope_statement`), from what :meth:`bindings_at` resolves it
        to: an import's names, a module-level ``=`` target's or definition's the name itself, a
        builtin's ``builtins.<name>``. None where only the scope analysis can tell."""
        found = self._bindings_at(full_name, line)
        if found is None:
            return None
        imports, others, local = found
        root = full_name.split(".", 1)[0]
        if not imports and not others:
            return {f"builtins.{root}"} if hasattr(builtins, root) else set()
        names = {name for b in imports for name in import_qualified(b, full_name)}
        if not others:
            return names
        if local:  # `<function>.<locals>.name`: no source's
            return names | {f"<locals>.{full_name}"}
        return names | {full_name}  # a module-level binding's name is the name

    def bindings_at(self, full_name: str, line: int) -> tuple[list[ImportBinding], list[ast.AST]] | None:
        """What libcst resolves the root of ``full_name``, read at file line ``line``, to: its
        imports, and its other bindings: ``name = ...``, ``for``/``with``/``except`` targets
        (``Name`` nodes) and ``def``/``class`` statements; both empty for a builtin or an unbound
        name.

        In a function's own scope libcst resolves the root to the function's own bindings of it
        (:meth:`_local_binders` for those other than imports), or (none there) to the
        module-level bindings the mini module holds (class bodies are skipped); a plain name keeps
        only the function's bindings made before it, and falls back to the module's when none is
        (an attribute chain keeps them all). At module level see :meth:`_at_module_level`. None
        where only the scope analysis can tell: a name declared ``global``/``nonlocal``, bound by
        a comprehension, by a star import, by the function as a parameter, walrus, ``del`` or
        match capture, or at module level other than by an import, ``=`` or a definition
        (``for``, ``with``, ``except``, walrus); a read in a closure, a class body, a lambda or on
        a line holding a comprehension, or on the line of a binding it may follow."""
        found = self._bindings_at(full_name, line)
        return None if found is None else (found[0], found[1])

    def _bindings_at(
        self, full_name: str, line: int
    ) -> tuple[list[ImportBinding], list[ast.AST], bool] | None:
        """:meth:`bindings_at`, and whether its non-import bindings are the function's own."""
        if not self._enabled:
            return None
        root, dotted_read = full_name.split(".", 1)[0], "." in full_name
        model = self._model
        if (
            root in self._wrappers
            or root in self._dotted_roots
            or root in model.declared_names()
            or root in model.comprehension_targets()
            or any(b.star for b in model.imports)
        ):
            return None
        bindings = [b for b in model.imports if b.name == root]
        if model.module_scope_statement(line) is not None:
            found = self._at_module_level(root, dotted_read, bindings, line)
            return None if found is None else (*found, False)
        function = model.own_scope_function(line)
        if function is None:
            return None
        own = [b for b in bindings if b.scopes and b.scopes[-1] is function]
        if any(b.node.lineno <= line <= (b.node.end_lineno or b.node.lineno) for b in own):
            return None  # `from m import f; f()`: which comes first is libcst's visiting order
        if not dotted_read:
            own = [b for b in own if b.node.lineno < line]
        if _binds_locally_otherwise(function, root):
            local = self._local_binders(function, root, line)
            if local is None:
                return None
            locals_ = [node for node, last in local if dotted_read or last < line]
            if own or locals_:
                return own, locals_, True
        elif own:
            return own, [], False
        others = model.module_binders(root, self._present)
        if others is None:
            return None
        return [b for b in bindings if not b.scopes and id(b.top) in self._present], others, False

    def _local_binders(self, function: ast.AST, root: str, line: int) -> list[tuple[ast.AST, int]] | None:
        """The bindings of ``root`` in ``function``'s own scope other than its imports, as libcst
        records them, each with the last line of what it runs before libcst counts it as made (the
        ``=`` statement, a ``for`` target, a ``with ... as`` / ``except ... as`` header, a nested
        definition with its decorators): a ``Name`` (a target; an ``except ... as`` name stands as
        a ``Name`` of it) or the ``def``/``class``. libcst resolves a plain read to the function's
        bindings made before it in its visiting order (the source order, across lines), and an
        attribute chain to all of them. None where that order or the binding is not provably
        libcst's: the read shares lines with one of them; a parameter (libcst counts it made with
        the first statement's bindings); a walrus, ``del``, match capture, or a comprehension's
        target."""
        if any(a.arg == root for a in _arguments(function.args)):  # type: ignore[attr-defined]
            return None
        if any(
            node.target.id == root and _spans(function, node.lineno)  # type: ignore[attr-defined]
            for node in astindex.of_type(self._model.tree, ast.NamedExpr)
        ):
            return None  # also one in a nested def's defaults or decorators, which binds here
        found: list[tuple[ast.AST, int]] = []
        for statement in function.body:  # type: ignore[attr-defined]
            for binder in _binders(statement, root):
                if isinstance(binder, ast.alias):
                    continue  # an import: bindings_at's own imports
                if isinstance(binder, (*_DEFS, ast.ClassDef)):
                    first, last = _start(binder), binder.end_lineno or binder.lineno
                elif isinstance(binder, ast.ExceptHandler):
                    first = binder.lineno
                    last = max(first, binder.body[0].lineno - 1)
                    binder = ast.Name(id=root, ctx=ast.Store())
                elif isinstance(binder, ast.Name) and isinstance(binder.ctx, ast.Store):
                    span = self._target_span(binder)
                    if span is None:
                        return None
                    first, last = span
                else:
                    return None
                if first <= line <= last:
                    return None  # which comes first is libcst's visiting order
                found.append((binder, last))
        return found

    def _target_span(self, target: ast.Name) -> tuple[int, int] | None:
        """The lines from the start of the statement part that binds ``target`` to where libcst
        counts it made: an ``=``/``+=``/annotated assignment's whole statement, a ``for``
        target, a ``with`` item's ``as`` target; None for any other place."""
        model = self._model
        node: ast.AST = target
        while (up := model.parent(node)) is not None:
            if isinstance(up, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                if node is up.value:
                    return None  # a walrus in the value
                return up.lineno, up.end_lineno or up.lineno
            if isinstance(up, (ast.For, ast.AsyncFor)):
                return (up.lineno, up.target.end_lineno or up.lineno) if node is up.target else None
            if isinstance(up, ast.withitem):
                if node is not up.optional_vars:
                    return None
                return up.context_expr.lineno, up.optional_vars.end_lineno or up.optional_vars.lineno
            if not isinstance(up, (ast.Tuple, ast.List, ast.Starred)):
                return None  # a walrus, a comprehension's target
            node = up
        return None

    def _at_module_level(
        self, root: str, dotted_read: bool, bindings: list[ImportBinding], line: int
    ) -> tuple[list[ImportBinding], list[ast.AST]] | None:
        """:meth:`bindings_at` of a read in a top-level statement of a chunk, outside any
        def, class, lambda or comprehension. The mini module's order decides what a plain name
        sees: the header first (every binding there comes before), then the chunks in the file's
        order; when no binding comes before, a builtin or nothing (an attribute chain sees them all)."""
        others = self._model.module_binders(root, self._present)
        if others is None:
            return None
        imports = [b for b in bindings if not b.scopes and id(b.top) in self._present]
        if dotted_read:
            return imports, others
        spans = [(b.node, b.top) for b in imports] + [(o, self._model.top_statement(o)) for o in others]
        if any(id(top) not in self._header_ids and _spans(node, line) for node, top in spans):
            return None  # `fn = wrap(fn)`: which comes first is libcst's visiting order
        earlier = {
            id(node)
            for node, top in spans
            if id(top) in self._header_ids or (getattr(node, "end_lineno", None) or node.lineno) < line  # type: ignore[attr-defined]
        }
        return [b for b in imports if id(b.node) in earlier], [o for o in others if id(o) in earlier]


def _import_binding(
    node: ast.Import | ast.ImportFrom,
    alias: ast.alias,
    top: ast.stmt,
    scopes: tuple[ast.AST, ...],
    module: bool,
) -> ImportBinding:
    """The :class:`ImportBinding` of one alias of ``node``."""
    if isinstance(node, ast.ImportFrom):
        base = "." * node.level + (node.module or "")
        qualified = f"{base}.{alias.name}" if base and not base.endswith(".") else base + alias.name
        name = alias.asname or alias.name
        imported = f"{node.module or ''}.{alias.name}"
    else:
        name = alias.asname or alias.name.split(".")[0]
        qualified = alias.name if alias.asname else name
        imported = alias.name
    return ImportBinding(name, qualified, imported, alias.asname, node, alias, top, scopes, module)


def _binds(node: ast.AST, name: str) -> bool:
    """Whether ``node`` binds ``name`` other than as an ``ast.Name`` target."""
    if isinstance(node, ast.arg):
        return node.arg == name
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.alias):
        return (node.asname or node.name.split(".")[0]) == name
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return name in node.names
    if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
        return node.name == name
    if isinstance(node, ast.MatchMapping):
        return node.rest == name
    return False


_TRY = (ast.Try, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
# a read that may run later than its line says: its flow is not the statement's
_DEFERRED = (ast.Lambda, ast.GeneratorExp)
_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")
_Step = tuple[ast.AST, str, list, int]  # (owner, its field, the block, the read's statement's index in it)


def _blocks(node: ast.AST) -> list[tuple[str, list]]:
    """The statement blocks of ``node``, named by field (a handler's or case's block by its index)."""
    out: list[tuple[str, list]] = []
    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            out.append((field, block))
    for i, handler in enumerate(getattr(node, "handlers", ()) or ()):
        out.append((f"handlers.{i}", handler.body))
    for i, case in enumerate(getattr(node, "cases", ()) or ()):
        out.append((f"cases.{i}", case.body))
    return out


def _header(node: ast.AST) -> list[ast.AST]:
    """The parts of a compound statement outside its blocks (test, iter, target, with items,
    decorators, arguments, bases); empty for a simple statement."""
    if not _blocks(node):
        return []
    return [
        child
        for field, value in ast.iter_fields(node)
        if field not in _BLOCK_FIELDS
        for child in (value if isinstance(value, list) else [value])
        if isinstance(child, ast.AST)
    ]


def _path_to(
    tree: ast.Module, line: int, starts: Callable[[list], list[int]]
) -> tuple[list[_Step], bool] | None:
    """The blocks from the module down to the statement holding ``line``: ``(owner, field, block,
    index)`` per level, the last one the read's program point (its statement, or the compound
    statement whose header holds ``line``: then True); None where that point is not one statement
    (see :meth:`SemanticModel.reaching`)."""
    path: list[_Step] = []
    owner: ast.AST = tree
    while True:
        hits = []
        for field, block in _blocks(owner):
            i = bisect.bisect_right(starts(block), line) - 1  # the last statement starting by `line`
            while i >= 0 and line <= (block[i].end_lineno or block[i].lineno):
                hits.append((field, block, i))  # `a; b`: more than one
                i -= 1
        if len(hits) > 1:
            return None  # `a; b` on one line
        if not hits:
            if owner is tree or isinstance(owner, (ast.While, *_TRY, ast.Match)):
                return None  # a loop's test, an `except`/`case` line
            if not _start(owner) <= line < min(block[0].lineno for _, block in _blocks(owner)):
                return None  # not its header: an `else:` line, a comment
            in_header = True
            break
        if any(_spans(node, line) for part in _header(owner) for node in ast.walk(part)):
            return None  # `if x: f(y)`: the header and the body share the line
        field, block, index = hits[0]
        path.append((owner, field, block, index))
        owner = block[index]
        if not _blocks(owner):
            in_header = False
            break
    if any(isinstance(node, _DEFERRED) and _spans(node, line) for node in ast.walk(owner)):
        return None
    return path, in_header


def _start(statement: ast.AST) -> int:
    """The first line of ``statement``, its decorators included."""
    decorators = getattr(statement, "decorator_list", None) or []
    return min([getattr(statement, "lineno", 0), *(d.lineno for d in decorators)])


def _spans(node: ast.AST, line: int) -> bool:
    """Whether ``node``'s lines hold ``line``."""
    first = getattr(node, "lineno", None)
    return first is not None and first <= line <= (getattr(node, "end_lineno", None) or first)


def _binders(node: ast.AST, name: str, parts: list[ast.AST] | None = None) -> list[ast.AST]:
    """The nodes in ``node`` (or only in ``parts`` of it) that bind ``name`` in ``node``'s scope:
    ``Name`` targets (walrus ones too), import aliases, a nested ``def``/``class`` of that name (not
    its body), ``except ... as`` and match captures."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = list(parts) if parts is not None else [node]
    while pending:
        item = pending.pop()
        if isinstance(item, ast.Name):
            if item.id == name and not isinstance(item.ctx, ast.Load):
                found.append(item)
            continue
        if _binds(item, name):
            found.append(item)
        if isinstance(item, SCOPES):
            continue  # its body is its own scope
        pending.extend(ast.iter_child_nodes(item))
    return found


def _binds_unconditionally(statement: ast.stmt, name: str) -> bool:
    """Whether running ``statement`` to its end always leaves ``name`` bound by it (or deleted):
    also an ``if`` with an ``else`` each of whose branches does (``if npu: from a import f`` /
    ``else: from b import f``; a branch that leaves first never reaches what follows)."""
    if isinstance(statement, ast.If) and statement.orelse:
        return all(
            any(_binds_unconditionally(inner, name) for inner in branch)
            for branch in (statement.body, statement.orelse)
        )
    if isinstance(statement, _IMPORTS):
        return any(_binds(alias, name) for alias in statement.names)
    if isinstance(statement, (*_DEFS, ast.ClassDef)):
        return statement.name == name
    targets: list[ast.AST] = []
    if isinstance(statement, (ast.Assign, ast.Delete)):
        targets = list(statement.targets)
    elif isinstance(statement, ast.AugAssign) or (isinstance(statement, ast.AnnAssign) and statement.value):
        targets = [statement.target]
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Name) and target.id == name:
            return True
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
    return False


def _arguments(args: ast.arguments) -> list[ast.arg]:
    """Every parameter of a signature."""
    extra = [a for a in (args.vararg, args.kwarg) if a is not None]
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *extra]


def _binds_locally_otherwise(function: ast.AST, name: str) -> bool:
    """Whether ``function`` binds ``name`` in its own scope other than by an import (a
    parameter, a target, a nested ``def``/``class``, ``except ... as``, a match capture)."""
    return any(a.arg == name for a in _arguments(function.args)) or any(  # type: ignore[attr-defined]
        not isinstance(binder, ast.alias)
        for statement in function.body  # type: ignore[attr-defined]
        for binder in _binders(statement, name)
    )


def _binds_any(node: ast.AST, name: str) -> bool:
    """Whether ``node`` binds ``name`` in any scope (a target, ``del``, a parameter, an import, a
    definition, ``global``/``nonlocal``, ``except ... as``, a match capture)."""
    if isinstance(node, ast.Name):
        return node.id == name and not isinstance(node.ctx, ast.Load)
    return _binds(node, name)


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _reads(function: ast.AST, name: str) -> Iterator[tuple[ast.Name | None, bool]]:
    """The reads of ``name`` in ``function``'s body: (the ``Name``, whether a scope nested in the
    function holds it); ``(None, False)`` for a string that may be an annotation naming it
    (libcst reads those too). As in Python and libcst, a nested def's decorators, defaults and
    annotations, a class's bases and a comprehension's first iterable run in the enclosing scope."""
    word = re.compile(rf"\b{re.escape(name)}\b")
    pending: list[tuple[ast.AST, bool]] = [(s, False) for s in function.body]  # type: ignore[attr-defined]
    while pending:
        node, nested = pending.pop()
        if isinstance(node, ast.Name):
            if node.id == name and isinstance(node.ctx, ast.Load):
                yield node, nested
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and word.search(node.value):
            yield None, False
            continue
        if isinstance(node, (*_DEFS, ast.Lambda, ast.ClassDef)):
            header: list[ast.AST] = [
                *getattr(node, "decorator_list", ()),
                *getattr(node, "bases", ()),
                *getattr(node, "keywords", ()),
            ]
            if isinstance(node, (*_DEFS, ast.Lambda)):
                header.append(node.args)
            if isinstance(node, _DEFS) and node.returns is not None:
                header.append(node.returns)
            pending.extend((part, nested) for part in header)
            inner = node.body if isinstance(node.body, list) else [node.body]
            pending.extend((child, True) for child in inner)
            continue
        if isinstance(node, _COMPREHENSIONS):
            first = node.generators[0].iter
            pending.append((first, nested))
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.comprehension):
                    pending.extend((part, True) for part in ast.iter_child_nodes(child) if part is not first)
                else:
                    pending.append((child, True))
            continue
        pending.extend((child, nested) for child in ast.iter_child_nodes(node))


def _binds_locally(function: ast.AST, name: str) -> bool:
    """Whether ``name`` is a local variable of ``function`` (a parameter or bound in its body)."""
    return any(a.arg == name for a in _arguments(function.args)) or any(  # type: ignore[attr-defined]
        _binders(statement, name)
        for statement in function.body  # type: ignore[attr-defined]
    )
