"""Thin function chunks: the statements of a function that mention nothing relevant, as
placeholders of the same lines, so the libcst pass parses what can hold a site.

A function chunk is parsed whole because rules may look at the function around a site (result
usage, later subscripts, the body of a ``with`` selector); on a long test function most of it is
setup the traversal skips anyway (:meth:`~flashport.rewriter.engine.transform.SiteTransformer.on_visit`
does not descend into statements whose text matches nothing ``relevant``). :func:`thin_text`
replaces each such statement by a placeholder spanning exactly its lines (``pass`` on one line,
``(`` ... ``)`` over several), keeping every other line, so line numbers, indentation and the
pairing with the file's ``ast`` statements (:mod:`~flashport.rewriter.source.spans`) stay as they were.

What stays whole: a statement that mentions something relevant, when it is a simple statement or
a compound one whose own lines (its header, the lines between its blocks) do; a compound
statement whose own lines do not is kept with its blocks thinned the same way. A statement that
shares a line with another, an ``elif`` branch and a decorated definition are never replaced.

The engine uses the thin text for a first pass and falls back to the whole chunks when that pass
may have seen a placeholder: a rule read an ancestor above the site's innermost statement or the
module, the scope analysis ran, or a statement could not be placed alone
(:func:`flashport.rewriter.engine.pipeline._run_rules`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence

import libcst as cst

from flashport.rules.base import RuleContext

_BLOCKS = ("body", "orelse", "finalbody")


def thin_text(
    lines: Sequence[str],
    start: int,
    end: int,
    nodes: Sequence[ast.stmt],
    relevant: re.Pattern[str],
    may_hold_site: Callable[[Sequence[ast.AST]], bool],
) -> str:
    """Lines ``start`` to ``end`` (1-based, inclusive) of ``lines``, with the irrelevant statements
    in the bodies of the functions among ``nodes`` replaced by placeholders (module docstring).
    ``may_hold_site(nodes)``: whether a site may sit among ``nodes`` (asked about a function's
    decorators, parameters and annotations: a site there keeps the function whole; its name,
    which often mentions a trigger, ``test_flash_attn_output``, is never a site)."""
    replaced: dict[int, tuple[int, str]] = {}  # first line -> (last line, placeholder text)
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not may_hold_site(_header(node)):
            _thin_block(node.body, lines, relevant, replaced)
    out: list[str] = []
    line = start
    while line <= end:
        if line in replaced:
            last, text = replaced[line]
            out.append(text)
            line = last + 1
        else:
            out.append(lines[line - 1])
            line += 1
    return "".join(out)


def _thin_block(
    body: Sequence[ast.stmt], lines: Sequence[str], relevant: re.Pattern[str], replaced: dict
) -> None:
    for stmt in body:
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        if getattr(stmt, "decorator_list", None) or _shares_lines(stmt, lines):
            continue
        if not any(relevant.search(lines[i]) for i in range(first - 1, last)):
            replaced[first] = (last, _placeholder(lines, first, last))
        elif (
            _blocks(stmt)
            and not _own_lines_relevant(stmt, lines, relevant)
            and not any(_shares_lines(child, lines) for block in _blocks(stmt) for child in block)
        ):
            for block in _blocks(stmt):
                if not _is_elif(block, lines):
                    _thin_block(block, lines, relevant, replaced)


def _header(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """The parts of a definition outside its body and name."""
    returns = [node.returns] if node.returns else []
    return [*node.decorator_list, node.args, *returns, *getattr(node, "type_params", ())]


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists of a compound statement (blocks, handlers, cases)."""
    found = [getattr(stmt, name) for name in _BLOCKS if getattr(stmt, name, None)]
    found += [handler.body for handler in getattr(stmt, "handlers", ())]
    found += [case.body for case in getattr(stmt, "cases", ())]
    return [block for block in found if isinstance(block, list) and block and isinstance(block[0], ast.stmt)]


def _is_elif(block: list[ast.stmt], lines: Sequence[str]) -> bool:
    """An ``orelse`` that is an ``elif`` branch (its ``If`` starts on an ``elif`` line)."""
    return (
        len(block) == 1
        and isinstance(block[0], ast.If)
        and lines[block[0].lineno - 1].lstrip().startswith("elif")
    )


def _own_lines_relevant(stmt: ast.stmt, lines: Sequence[str], relevant: re.Pattern[str]) -> bool:
    """Whether the lines of ``stmt`` outside its blocks' statements (the header, decorators,
    ``else:``/``except`` lines and comments between blocks) mention something relevant; an
    ``elif`` branch's lines count as its parent's own."""
    first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", ())])
    covered: set[int] = set()
    for block in _blocks(stmt):
        if _is_elif(block, lines):
            continue
        for child in block:
            covered.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    last = stmt.end_lineno or stmt.lineno
    return any(relevant.search(lines[i - 1]) for i in range(first, last + 1) if i not in covered)


def _shares_lines(stmt: ast.stmt, lines: Sequence[str]) -> bool:
    """Whether ``stmt`` shares its first or last line with other code (``a = 1; b = 2``, a
    one-line suite ``if x: y``)."""
    head = lines[stmt.lineno - 1].encode("utf-8")[: stmt.col_offset]
    last = stmt.end_lineno or stmt.lineno
    tail = lines[last - 1].encode("utf-8")[stmt.end_col_offset or 0 :].strip()
    return bool(head.strip()) or (bool(tail) and not tail.startswith(b"#"))


def _placeholder(lines: Sequence[str], first: int, last: int) -> str:
    """A statement spanning lines ``first`` to ``last`` at the indentation of the first, each
    line keeping its own line ending."""
    line = lines[first - 1]
    indent = line[: len(line) - len(line.lstrip(" \t\f"))]
    endings = [_ending(lines[i - 1]) for i in range(first, last + 1)]
    if first == last:
        return f"{indent}pass{endings[0]}"
    return f"{indent}({endings[0]}" + "".join(endings[1:-1]) + f"){endings[-1]}"


def _ending(line: str) -> str:
    return line[len(line.rstrip("\r\n")) :]


class Abandoned(Exception):
    """Raised in a thin pass once a rule has returned after a read that a placeholder may answer
    (the engine then parses the whole chunks). Never raised through rule code: the watchers below
    only record the read (a rule's own ``except Exception`` could swallow an exception)."""


class Watched(tuple):
    """A rule's ``ctx.ancestors`` that calls ``note`` when a rule reads an ancestor above index
    ``limit`` (the site's innermost statement, which a thin chunk keeps whole; -1: the site is a
    statement) or compares or copies the tuple as a whole."""

    limit: int
    note: Callable[[], None]

    def __new__(cls, items: Sequence[cst.CSTNode], limit: int, note: Callable[[], None]) -> Watched:
        """The watched tuple of ``items``."""
        self = super().__new__(cls, items)
        self.limit, self.note = limit, note
        return self

    def _whole(self) -> None:
        if len(self) > self.limit + 1:
            self.note()

    def __getitem__(self, index):
        """Item or slice; an index above ``limit`` is noted."""
        if isinstance(index, slice):
            if any(i > self.limit for i in range(*index.indices(len(self)))):
                self.note()
        elif (index if index >= 0 else len(self) + index) > self.limit:
            self.note()
        return tuple.__getitem__(self, index)

    def __iter__(self):
        """The items in order; going past ``limit`` is noted."""
        for i in range(len(self)):
            if i > self.limit:
                self.note()
            yield tuple.__getitem__(self, i)

    def __reversed__(self):
        """The items from the last (noted when there are any above ``limit``)."""
        self._whole()
        return tuple.__iter__(tuple(tuple.__iter__(self))[::-1])


def _noting(name: str):
    def method(self, *args):
        self._whole()
        return getattr(tuple, name)(self, *args)

    method.__name__ = name
    method.__doc__ = f"``tuple.{name}``, noted as a read of every item."
    return method


for _name in (
    "__contains__", "index", "count", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__hash__", "__add__", "__mul__", "__rmul__", "__repr__", "__reduce__", "__reduce_ex__",
    "__getnewargs__",
):  # fmt: skip
    setattr(Watched, _name, _noting(_name))


class WatchedContext(RuleContext):
    """A :class:`~flashport.rules.base.RuleContext` whose ``module`` read is noted (through its
    :class:`Watched` ancestors): the module of a thin pass holds placeholders, that of a pruned pass
    leaves chunks out."""

    def __getattribute__(self, name: str):
        """Attribute access; ``module`` is noted."""
        if name == "module":
            ancestors = object.__getattribute__(self, "ancestors")
            if isinstance(ancestors, Watched):
                ancestors.note()
        return object.__getattribute__(self, name)
