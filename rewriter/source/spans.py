"""Statement line spans from the file's ``ast``; positions and renders one statement at a time.

Rendering the whole mini module to get libcst positions (:mod:`~flashport.rewriter.source.positions`) and
again to get the rewritten text costs as much as parsing it, although only the few statements that
hold a site need positions and only the rewritten ones need new text. :class:`StatementSpans`
pairs every libcst statement of the chunks with the ``ast`` statements it holds (the C parser's
line numbers, already computed for the file), so the engine knows where each statement sits
without rendering anything. A statement's node positions then come from rendering that statement
alone, from its first line, with the indentation of its enclosing blocks; its rewritten text is
rendered the same way and spliced in its place.

Every such render of an original statement is checked against the mini module's own lines (libcst
renders a tree back to the exact text it parsed): on a mismatch :attr:`StatementSpans.failed` is
set and the caller falls back to rendering the whole module, so a pairing mistake can cost time
but never change a result.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence

import libcst as cst
from libcst._nodes.internal import CodegenState

from flashport.rewriter.source.positions import Span, _TupleState
from flashport.rewriter.source.text import split_lines

_SENTINEL = re.compile(r"# flashport-chunk-(\d+)$")
_PAIRS: dict[type, tuple[type, ...]] = {
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef),
    cst.ClassDef: (ast.ClassDef,),
    cst.If: (ast.If,),
    cst.For: (ast.For, ast.AsyncFor),
    cst.While: (ast.While,),
    cst.With: (ast.With, ast.AsyncWith),
    cst.Try: (ast.Try,),
    cst.TryStar: (getattr(ast, "TryStar", ast.Try),),
    cst.Match: (getattr(ast, "Match", ast.If),),
}


class _Mismatch(Exception):
    """The libcst and ``ast`` statement lists do not pair up."""


class _Positions:
    """The ``provider`` a :class:`~flashport.rewriter.source.positions._TupleState` records into."""

    def __init__(self) -> None:
        self._computed: dict[cst.CSTNode, Span] = {}


class StatementSpans:
    """Where each chunk statement of a mini module sits, and its node positions on demand.

    Args:
      module: the parsed mini module.
      lines: the mini module's lines, endings kept.
      units: the chunk units in mini-module order (``_MiniModule.ordered``).
      line_map: ``(first, last mini-module line, first file line)`` per chunk, same order.
    """

    def __init__(
        self,
        module: cst.Module,
        lines: Sequence[str],
        units: Sequence[object],
        line_map: Sequence[tuple[int, int, int]],
    ):
        self.module = module
        self.lines = lines
        self.failed = False
        self._lines_of: dict[int, tuple[int, int, bool]] = {}  # id(stmt) -> (first, last, compound)
        self._rendered: dict[int, tuple[int, int]] = {}  # id(stmt) -> (first line, lines) rendered
        self._header: set[int] = set()  # ids of the import header's statements
        self._elif: set[int] = set()  # ids of the ``If`` nodes that are an ``elif``
        self._positions = _Positions()
        try:
            self._pair_module(module, units, line_map)
        except (_Mismatch, IndexError, AttributeError):
            self.failed = True

    # -- pairing -----------------------------------------------------------------------------

    def _pair_module(self, module: cst.Module, units: Sequence[object], line_map) -> None:
        """Group the chunk statements by their sentinel comment and pair each group with its unit."""
        groups: dict[int, list[cst.CSTNode]] = {}
        current: list[cst.CSTNode] | None = None
        index = _first_index(module.header)
        if index is not None:  # no header imports: the first sentinel is the module's header
            current = groups.setdefault(index, [])
        for statement in _top_statements(module):
            index = _sentinel(statement)
            if index is not None:
                current = groups.setdefault(index, [])
            elif isinstance(statement, cst.ClassDef) and statement.name.value.startswith("_flashport_chunk_"):
                current = None  # the stand-in class itself; its members carry their own sentinels
                continue
            if current is not None:
                current.append(statement)
            else:
                self._header.add(id(statement))
        if sorted(groups) != list(range(len(units))):
            raise _Mismatch
        for index, statements in groups.items():
            first, _, file_line = line_map[index]
            self._pair(statements, units[index].nodes, file_line - first)  # type: ignore[attr-defined]

    def _pair(self, statements: Iterable[cst.CSTNode], nodes: Sequence[ast.stmt], shift: int) -> None:
        """Pair a block's libcst statements with its ``ast`` statements (``shift``: file minus
        mini-module line)."""
        at = 0
        for statement in statements:
            if isinstance(statement, cst.SimpleStatementLine):
                group = nodes[at : at + len(statement.body)]
                if len(group) != len(statement.body) or not group:
                    raise _Mismatch
                at += len(group)
                first, last = group[0].lineno, group[-1].end_lineno or group[-1].lineno
                self._lines_of[id(statement)] = (first - shift, last - shift, False)
                continue
            node = nodes[at]
            at += 1
            self._compound(statement, node, shift)
        if at != len(nodes):
            raise _Mismatch

    def _compound(self, statement: cst.CSTNode, node: ast.stmt, shift: int) -> None:
        """Record a compound statement's lines and pair the statements of its blocks."""
        if not isinstance(node, _PAIRS.get(type(statement), ())):
            raise _Mismatch
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
        self._lines_of[id(statement)] = (first - shift, (node.end_lineno or node.lineno) - shift, True)
        if not isinstance(statement, cst.Match):
            self._block(statement.body, node.body, shift)  # type: ignore[attr-defined]
        if isinstance(statement, cst.If) and isinstance(node, ast.If):
            if isinstance(statement.orelse, cst.If):
                if len(node.orelse) != 1:
                    raise _Mismatch
                self._elif.add(id(statement.orelse))
                self._compound(statement.orelse, node.orelse[0], shift)
            elif statement.orelse is not None:
                self._block(statement.orelse.body, node.orelse, shift)
        elif isinstance(statement, (cst.For, cst.While)) and statement.orelse is not None:
            self._block(statement.orelse.body, node.orelse, shift)  # type: ignore[attr-defined]
        elif isinstance(statement, (cst.Try, cst.TryStar)):
            handlers = node.handlers  # type: ignore[attr-defined]
            if len(handlers) != len(statement.handlers):
                raise _Mismatch
            for handler, ast_handler in zip(statement.handlers, handlers, strict=True):
                self._block(handler.body, ast_handler.body, shift)  # type: ignore[attr-defined]
            if statement.orelse is not None:
                self._block(statement.orelse.body, node.orelse, shift)  # type: ignore[attr-defined]
            if statement.finalbody is not None:
                self._block(statement.finalbody.body, node.finalbody, shift)  # type: ignore[attr-defined]
        elif isinstance(statement, cst.Match):
            cases = node.cases  # type: ignore[attr-defined]
            if len(cases) != len(statement.cases):
                raise _Mismatch
            for case, ast_case in zip(statement.cases, cases, strict=True):
                self._block(case.body, ast_case.body, shift)

    def _block(self, suite: cst.BaseSuite, nodes: Sequence[ast.stmt], shift: int) -> None:
        """Pair an indented block's statements (a one-line suite holds no libcst statements)."""
        if isinstance(suite, cst.IndentedBlock):
            self._pair(suite.body, nodes, shift)

    # -- questions ---------------------------------------------------------------------------

    def lines_of(self, statement: cst.CSTNode) -> tuple[int, int] | None:
        """The mini-module lines a libcst ``PositionProvider`` span of ``statement`` covers (a
        compound statement's span ends on the line after its block; a decorated one starts at its
        first decorator here, at its keyword there), ``(0, -1)`` for a header statement (outside
        the chunks), None when unknown."""
        if id(statement) in self._header:
            return 0, -1
        found = self._lines_of.get(id(statement))
        if found is None:
            return None
        first, last, compound = found
        return first, last + 1 if compound else last

    def position(self, node: cst.CSTNode, path: Sequence[cst.CSTNode]) -> Span | None:
        """``node``'s span (mini-module lines), rendering the innermost statement of ``path``
        (the original nodes from the module down to ``node``) that holds it, once."""
        computed = self._positions._computed
        if node in computed or self.failed:
            return computed.get(node)
        for index in range(len(path) - 1, -1, -1):
            statement = path[index]
            if id(statement) in self._lines_of:
                if id(statement) not in self._rendered:
                    self._render_positions(statement, indents(path[:index], self.module))
                return computed.get(node)
        return None

    def _flags(self, statement: cst.CSTNode) -> dict[str, bool]:
        """Codegen keywords that render ``statement`` as it sits (an ``elif`` branch)."""
        return {"is_elif": True} if id(statement) in self._elif else {}

    def _start(self, statement: cst.CSTNode) -> int:
        """The mini-module line where ``statement``'s rendering (leading lines included) starts."""
        first = self._lines_of[id(statement)][0] - len(getattr(statement, "leading_lines", ()))
        decorators = getattr(statement, "decorators", ())
        return first - len(decorators[0].leading_lines) if decorators else first

    def _render_positions(self, statement: cst.CSTNode, indent: Sequence[str]) -> None:
        """Record the positions of ``statement``'s nodes, checking the render against the text."""
        start = self._start(statement)
        provider = _Positions()
        state = _TupleState(
            default_indent=self.module.default_indent,
            default_newline=self.module.default_newline,
            provider=provider,  # type: ignore[arg-type]  # duck-typed: the state only fills _computed
        )
        state.indent_tokens = list(indent)
        state.line = start
        statement._codegen(state, **self._flags(statement))
        count = self._matches(start, "".join(state.tokens))
        if not count:
            self.failed = True
            return
        self._rendered[id(statement)] = (start, count)
        self._positions._computed.update(provider._computed)

    def _matches(self, start: int, text: str) -> int:
        """How many lines ``text`` has when it is exactly the mini module's lines from ``start``
        on, else 0."""
        count = len(split_lines(text))
        same = start >= 1 and "".join(self.lines[start - 1 : start - 1 + count]) == text
        return count if same else 0

    def replacement(
        self, original: cst.CSTNode, updated: cst.CSTNode, indent: Sequence[str]
    ) -> tuple[int, int, str] | None:
        """``(first, last mini-module line, new text)`` replacing ``original`` by ``updated``
        (with their leading lines when ``original`` was rendered for positions, which checked
        where it sits; else without, checking that now); None when it cannot be spliced alone."""
        if self.failed or id(original) not in self._lines_of or not isinstance(updated, cst.BaseStatement):
            return None
        flags = self._flags(original)
        known = self._rendered.get(id(original))
        if known is not None and _sentinel(original) is None:  # a chunk's sentinel stays out
            start, count = known
            return start, start + count - 1, _render(updated, indent, self.module, flags)
        if not _same_lines(getattr(original, "leading_lines", ()), getattr(updated, "leading_lines", ())):
            return None
        start = self._lines_of[id(original)][0]
        decorators = getattr(original, "decorators", ())
        if decorators:
            start -= len(decorators[0].leading_lines)
        old = _render(original.with_changes(leading_lines=()), indent, self.module, flags)
        count = self._matches(start, old)
        if not count:
            return None
        new = _render(updated.with_changes(leading_lines=()), indent, self.module, flags)
        return start, start + count - 1, new


def indents(path: Sequence[cst.CSTNode], module: cst.Module) -> list[str]:
    """The indentation tokens libcst's codegen holds inside the blocks of ``path`` (a ``match``
    indents its cases too)."""
    return [
        module.default_indent if node.indent is None else node.indent
        for node in path
        if isinstance(node, (cst.IndentedBlock, cst.Match))
    ]


def _render(node: cst.CSTNode, indent: Sequence[str], module: cst.Module, flags: dict) -> str:
    """``node``'s source text rendered inside blocks indented by ``indent`` (``module``'s defaults;
    ``flags``: codegen keywords, ``is_elif``)."""
    state = CodegenState(default_indent=module.default_indent, default_newline=module.default_newline)
    state.indent_tokens = list(indent)
    node._codegen(state, **flags)
    return "".join(state.tokens)


def _same_lines(a: Sequence[cst.CSTNode], b: Sequence[cst.CSTNode]) -> bool:
    return len(a) == len(b) and all(x is y or x.deep_equals(y) for x, y in zip(a, b, strict=True))


def _top_statements(module: cst.Module) -> Iterable[cst.CSTNode]:
    """The module's statements, with the members of each stand-in class after the class."""
    for statement in module.body:
        yield statement
        if isinstance(statement, cst.ClassDef) and statement.name.value.startswith("_flashport_chunk_"):
            if isinstance(statement.body, cst.IndentedBlock):
                yield from statement.body.body


def _sentinel(statement: cst.CSTNode) -> int | None:
    """The chunk index of the sentinel comment among ``statement``'s leading lines, if any."""
    return _first_index(getattr(statement, "leading_lines", ()))


def _first_index(lines: Iterable[cst.EmptyLine]) -> int | None:
    """The chunk index of the first sentinel comment among ``lines`` (None: none)."""
    return next((i for i in map(_comment_index, lines) if i is not None), None)


def _comment_index(line: cst.EmptyLine) -> int | None:
    """The chunk index of a sentinel comment line (None for any other line)."""
    found = _SENTINEL.match(line.comment.value) if line.comment is not None else None
    return int(found.group(1)) if found else None
