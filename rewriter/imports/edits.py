"""Import management after rewrites, done as line splices on the new text.

* :func:`ensure_import` adds ``import flashport`` once, unguarded, where isort would put it (the
  third-party group, sorted the way the file sorts; flashport is always installed where rewritten
  code runs).
* :func:`remove_unused` drops imports from GPU-only modules (``flash_attn``) whose names a rewrite
  made unused, at every scope, with ``try: ... except ImportError`` / ``if available():`` guards and
  fallbacks that only existed for them (:mod:`flashport.rewriter.imports.dead_imports`); a name still used
  anywhere (feature probes like ``inspect.signature(flash_attn_func)``) keeps its import.
"""

from __future__ import annotations

import ast
import collections
import copy as copy_module
import dataclasses
import re
import sys
from collections.abc import Iterable

import libcst as cst

from flashport.rewriter.imports import dead_imports, drop_in_imports, kept_imports
from flashport.rewriter.source import astindex, reparse
from flashport.rewriter.source.text import first_line, split_lines


def name_uses(tree: ast.AST) -> collections.Counter:
    """How often each name is read (``Name`` loads, plus strings listed in ``__all__``)."""
    uses = drop_in_imports.exported(tree)
    for node in astindex.of_type(tree, ast.Name):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            uses[node.id] += 1
    return uses


def remove_unused(
    text: str,
    before: collections.Counter,
    gpu_modules: tuple[str, ...],
    tree: ast.Module | None = None,
    version: tuple[int, ...] = (2, 8, 3),
) -> tuple[str, list[str]]:
    """Drop GPU imports whose bound names were read in ``before`` and are unread now, at every
    scope, with the ``try``/``if`` guards and fallbacks that only existed for them
    (:mod:`flashport.rewriter.imports.dead_imports`); pin ``flash_attn.__version__`` reads to ``version``
    (the flash-attn release the port was written for) and point imports whose names are only
    probed or re-exported at flashport's drop-ins where that frees the file of the GPU library
    (:mod:`flashport.rewriter.imports.drop_in_imports`). ``tree``: ``ast.parse(text)`` when the caller has it.

    Returns the new text and the dotted names removed (or moved to a drop-in).
    """
    cleaned, removed, _ = _remove_unused(text, before, gpu_modules, tree, version)
    return cleaned, removed


def _remove_unused(
    text: str,
    before: collections.Counter,
    gpu_modules: tuple[str, ...],
    tree: ast.Module | None,
    version: tuple[int, ...],
) -> tuple[str, list[str], list[reparse.Edit] | None]:
    """:func:`remove_unused`, and the line edits that turned ``text`` into the new text (None when
    they are not known line by line)."""
    if not gpu_modules:
        return text, [], []
    tree = tree if tree is not None else ast.parse(text)
    after = name_uses(tree)
    pinned = drop_in_imports.pin_versions(text, tree, before, after, gpu_modules, version)
    if pinned == text:
        return dead_imports.remove_dead(text, tree, before, after, gpu_modules, _drop_aliases, version)
    tree = ast.parse(pinned)
    cleaned, removed, _ = dead_imports.remove_dead(
        pinned, tree, before, name_uses(tree), gpu_modules, _drop_aliases, version
    )
    return cleaned, removed, None


@dataclasses.dataclass
class ImportEdits:
    """The import edits of one rewritten file: its new text, the modules added, the dotted names
    removed (or moved to a drop-in) and why each GPU import left stays
    (:func:`flashport.rewriter.imports.kept_imports.explain`)."""

    text: str
    added: list[str]
    removed: list[str]
    kept: list[str]
    starts: list[int] = dataclasses.field(default_factory=list)  # first lines of its top-level statements


def edit_imports(
    text: str,
    tree: ast.Module,
    before: collections.Counter,
    gpu_modules: tuple[str, ...],
    needed: Iterable[str],
    newline: str,
    version: tuple[int, ...] = (2, 8, 3),
    whole_parse: bool = False,
) -> ImportEdits:
    """Drop GPU imports a rewrite made unused (:func:`remove_unused`), add ``import <module>`` for
    each module in ``needed`` (:func:`ensure_imports`, in sorted order) and say why each GPU import
    left stays. ``text``: the rewritten file, ``tree``: ``ast.parse(text)``, ``before``: the
    original file's :func:`name_uses`. The text is parsed again only when the clean-up changed it,
    and then only the statements it changed (:func:`~flashport.rewriter.source.reparse.reparse`;
    the whole text with ``whole_parse``, and ``tree`` must not be used afterwards). The added
    imports need no parse: their lines are counted, and no name is read in an import. ``starts``
    gives the first line of each top-level statement of the new text."""
    cleaned, removed, changes = _remove_unused(text, before, gpu_modules, tree, version)
    if cleaned == text:
        cleaned_tree = tree
    elif changes is None or whole_parse:
        cleaned_tree = ast.parse(cleaned)
    else:
        cleaned_tree = reparse.reparse(tree, len(split_lines(text)), cleaned, changes)
    new_text, shift = cleaned, LineShift()
    added: list[str] = []
    modules = sorted(needed)
    if modules:
        new_text, added, shift = ensure_imports(cleaned, modules, newline, cleaned_tree)
    kept: list[str] = []
    if imports_any(new_text, gpu_modules):
        after = name_uses(cleaned_tree)
        kept = kept_imports.explain(cleaned_tree, before, after, gpu_modules, version, shift)
    starts = [shift(first_line(node)) for node in cleaned_tree.body]
    return ImportEdits(new_text, added, removed, kept, starts)


def imports_any(text: str, modules: tuple[str, ...]) -> bool:
    """A line of ``text`` may import one of ``modules`` (a cheap test before parsing)."""
    if not modules:
        return False
    names = "|".join(re.escape(m) for m in modules)
    return (
        re.search(
            rf"^[ \t]*(from|import)[ \t]+({names})\b|^[ \t]*import[ \t].*,[ \t]*({names})\b", text, re.M
        )
        is not None
    )


def _drop_aliases(stmt_text: str, names: set[str]) -> str | None:
    """Remove aliases (by bound name) from one import statement's text, keeping its indentation."""
    stmt_lines = split_lines(stmt_text)
    indent = stmt_lines[0][: len(stmt_lines[0]) - len(stmt_lines[0].lstrip(" \t"))]
    body = "".join(line[len(indent) :] if line.startswith(indent) else line for line in stmt_lines)
    try:
        module = cst.parse_module(body)
    except cst.ParserSyntaxError:
        return None

    class _Drop(cst.CSTTransformer):
        def leave_ImportFrom(self, original, updated):
            if isinstance(updated.names, cst.ImportStar):
                return updated
            kept = [a for a in updated.names if (a.evaluated_alias or a.evaluated_name) not in names]
            if not kept:
                return updated
            if updated.rpar is not None:
                kept[-1] = kept[-1].with_changes(
                    comma=_closing_comma(kept[-1].comma, updated.names[-1].comma)
                )
            else:
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(names=kept)

        def leave_Import(self, original, updated):
            kept = [
                a for a in updated.names if (a.evaluated_alias or a.evaluated_name.split(".")[0]) not in names
            ]
            if not kept:
                return updated
            kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(names=kept)

    new_body = module.visit(_Drop()).code
    out_lines = split_lines(new_body)
    return "".join((indent + line) if i == 0 or line.strip() else line for i, line in enumerate(out_lines))


def _closing_comma(own, last):
    """The comma for the new last alias of a parenthesized import.

    What sits before ``)`` (the newline and indentation of the closing parenthesis) belongs to the
    old last alias's comma, or to ``rpar`` when it had none. The new last alias keeps its own
    comma and line comment and takes over the old last one's line break and indentation; without
    a trailing comma before, it loses its comma.
    """
    if not isinstance(last, cst.Comma):
        return cst.MaybeSentinel.DEFAULT
    if not isinstance(own, cst.Comma):
        return last
    mine, theirs = own.whitespace_after, last.whitespace_after
    if isinstance(mine, cst.ParenthesizedWhitespace) and isinstance(theirs, cst.ParenthesizedWhitespace):
        return own.with_changes(
            whitespace_after=mine.with_changes(indent=theirs.indent, last_line=theirs.last_line)
        )
    return last


def has_import(tree: ast.Module, module: str) -> bool:
    """True when the module has an unguarded top-level ``import <module>`` (or a submodule)."""
    return _has_import(tree.body, module)


def _has_import(body: list[ast.stmt], module: str) -> bool:
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is None and (alias.name == module or alias.name.startswith(module + ".")):
                    return True
    return False


def ensure_import(text: str, module: str, newline: str, tree: ast.Module | None = None) -> tuple[str, bool]:
    """Add ``import <module>`` once, where isort would put it; returns (text, added).

    The statement joins the file's third-party import group (the first blank-line separated group
    of top-level imports after the standard-library ones that holds an absolute, non-stdlib import),
    sorted as the group already is: among the plain ``import x`` statements when they all come
    before the ``from x import`` ones (isort's default), else among all by module name
    (``force_sort_within_sections``). Without such a group it gets its own, after the standard
    library group or before the local (relative) one; without imports, it goes after the module
    docstring and ``from __future__`` imports. ``tree``: ``ast.parse(text)`` when the caller has it.
    """
    text, added, _ = ensure_imports(text, [module], newline, tree)
    return text, bool(added)


def ensure_imports(
    text: str, modules: Iterable[str], newline: str, tree: ast.Module | None = None
) -> tuple[str, list[str], LineShift]:
    """Add ``import <module>`` for each of ``modules`` in turn, each placed as :func:`ensure_import`
    places it in the text the earlier ones left, in one edit from one parse: the top-level
    statements' line numbers are moved past each inserted line instead of parsing the new text
    again. ``tree``: ``ast.parse(text)`` when the caller has it.

    Returns the new text, the modules added and the :class:`LineShift` from lines of ``text`` to
    lines of the new text.
    """
    tree = tree if tree is not None else ast.parse(text)
    layout = _Layout(split_lines(text), [_moved_copy(node) for node in tree.body], LineShift())
    added = []
    for module in modules:
        if not _has_import(layout.body, module):
            _add(layout, module, newline)
            added.append(module)
    return "".join(layout.lines), added, layout.shift


@dataclasses.dataclass
class LineShift:
    """Where the lines of a text went after lines were inserted into it (and blank leading lines
    dropped): ``edits`` holds ``(after, delta)``, applied in order; a line number above ``after``
    moves by ``delta``."""

    edits: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def __call__(self, line: int) -> int:
        """The new number of (1-based) ``line``."""
        for after, delta in self.edits:
            if line > after:
                line += delta
        return line


@dataclasses.dataclass
class _Layout:
    """The text being edited, one entry a line, its top-level statements (copies whose line
    numbers follow the edits) and the line shift so far."""

    lines: list[str]
    body: list[ast.stmt]
    shift: LineShift

    def insert(self, index: int, text: str, statement: str | None = None) -> None:
        """Put ``text`` before ``lines[index]``; ``statement``: the module of the ``import`` line
        it holds (it joins ``body``)."""
        new = split_lines(text)
        self.lines[index:index] = new
        self.move(index, len(new))
        if statement is not None:
            at = index + 1 + next(i for i, line in enumerate(new) if line.startswith("import "))
            node = ast.Import(names=[ast.alias(name=statement)], lineno=at, end_lineno=at, col_offset=0)
            self.body.insert(sum(1 for n in self.body if n.lineno < at), node)

    def move(self, after: int, delta: int) -> None:
        """Line numbers above ``after`` move by ``delta``."""
        self.shift.edits.append((after, delta))
        for node in self.body:
            _shift(node, after, delta)
            for decorator in getattr(node, "decorator_list", ()):
                _shift(decorator, after, delta)


def _moved_copy(node: ast.stmt) -> ast.stmt:
    """A shallow copy of a top-level statement whose line numbers (and its decorators') may move."""
    copy = copy_module.copy(node)
    if getattr(node, "decorator_list", None):
        copy.decorator_list = [copy_module.copy(d) for d in node.decorator_list]  # type: ignore[attr-defined]
    return copy


def _shift(node: ast.AST, after: int, delta: int) -> None:
    if node.lineno > after:  # type: ignore[attr-defined]
        node.lineno += delta  # type: ignore[attr-defined]
    end = getattr(node, "end_lineno", None)
    if end is not None and end > after:
        node.end_lineno = end + delta  # type: ignore[attr-defined]


def _add(layout: _Layout, module: str, newline: str) -> None:
    """Insert ``import <module>`` into ``layout`` (see :func:`ensure_import`)."""
    lines = layout.lines
    statement = f"import {module}{newline}"
    groups = _import_groups(layout.body, lines)
    third = next((g for g in groups if any(_section(n) == "third" for n in g)), None)
    leading = _leading_statement(layout.body)
    if third is not None:
        line = _sorted_position(third, module, lines, leading)
        if line > len(lines):  # after the group ending the file: the last line may lack its newline
            _terminate(lines, len(lines), newline)
        layout.insert(line - 1, statement, module)
        return
    std = [
        g
        for g in groups
        if all(_section(n) in ("stdlib", "future") for n in g) and any(_section(n) == "stdlib" for n in g)
    ]
    local = [g for g in groups if any(_section(n) == "local" for n in g)]
    if std and (not local or std[-1][-1].lineno < local[0][0].lineno):
        end = std[-1][-1].end_lineno or std[-1][-1].lineno
        _terminate(lines, end, newline)
        below = newline if end < len(lines) and lines[end].strip() else ""  # keep the group apart
        layout.insert(end, newline + statement + below, module)
    elif local:
        layout.insert(_above_comments(lines, local[0][0].lineno, leading) - 1, statement + newline, module)
    else:
        _after_header(layout, statement, module, newline)


def _leading_statement(body: list[ast.stmt]) -> int:
    """The first line of the first top-level statement after the docstring and ``__future__``
    imports (0 when there is none)."""
    for index, node in enumerate(body):
        docstring = (
            index == 0
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        )
        if not docstring and not _is_future(node):
            return first_line(node)
    return 0


def _terminate(lines: list[str], line: int, newline: str) -> None:
    if not lines[line - 1].endswith(("\n", "\r")):
        lines[line - 1] += newline


def _after_header(layout: _Layout, statement: str, module: str, newline: str) -> None:
    """``statement`` after the docstring and ``__future__`` imports (a file without other imports)."""
    lines, body = layout.lines, layout.body
    index = 0
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        index = 1
    while index < len(body) and _is_future(body[index]):
        index += 1
    if index > 0:  # after the docstring / __future__ imports and the comments right below them
        last_line = body[index - 1].end_lineno or len(lines)
        _terminate(lines, last_line, newline)
        while last_line < len(lines) and lines[last_line].lstrip().startswith("#"):
            last_line += 1
        _terminate(lines, last_line, newline)
        gap = _gap_below(lines, last_line, body[index] if index < len(body) else None)
        above = newline if _is_future(body[index - 1]) else ""  # isort's blank line after __future__
        layout.insert(last_line, above + statement + newline * gap, module)
    elif body:  # before the first statement (comments, shebang and coding line stay above)
        node = body[0]
        at = first_line(node) - 1
        layout.insert(at, statement + newline * _gap_below(lines, at, node), module)
        if not any(line.strip() for line in lines[:at]):
            del lines[:at]  # only blank lines above (left by removed imports): the import leads the file
            layout.move(at, -at)
    else:
        if lines and not lines[-1].endswith(("\n", "\r")):
            lines[-1] += newline
        layout.insert(len(lines), statement, module)


def _gap_below(lines: list[str], line: int, following: ast.stmt | None) -> int:
    """Blank lines to add below an import inserted after (1-based) ``line``, as isort leaves them:
    2 above a def/class, else 1, counting the blank lines already there (none at the end of file)."""
    blank = 0
    while line + blank < len(lines) and not lines[line + blank].strip():
        blank += 1
    if line + blank >= len(lines):
        return 0
    first = None
    if following is not None:
        first = first_line(following)
    definition = isinstance(following, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    wanted = 2 if definition and first == line + blank + 1 else 1
    return max(0, wanted - blank)


def _is_future(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "__future__"


def _section(node: ast.stmt) -> str:
    """isort's section of a top-level import: future, stdlib, local (relative) or third."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return "local"
        name = node.module or ""
    elif isinstance(node, ast.Import):
        name = node.names[0].name
    else:
        raise TypeError(f"not an import statement: {type(node).__name__} at line {node.lineno}")
    top = name.split(".")[0]
    if top == "__future__":
        return "future"
    return "stdlib" if top in sys.stdlib_module_names else "third"


def _import_groups(body: list[ast.stmt], lines: list[str]) -> list[list[ast.stmt]]:
    """Top-level, one-per-line import statements of the leading import region, split at blank lines.

    A guarded import block (``try: from typing import Literal`` / ``except ImportError: ...``,
    ``if TYPE_CHECKING: ...``) belongs to the region but to no group: it ends the group above it.
    """
    groups: list[list[ast.stmt]] = []
    previous = None
    for node in body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            if (
                previous is None
                and isinstance(node, ast.Expr)
                and isinstance(getattr(node, "value", None), ast.Constant)
            ):
                continue  # the docstring
            if groups and _guarded_imports(node):
                groups.append([])  # the next import starts a new group
                continue
            if groups:
                break
            continue
        end = node.end_lineno or node.lineno
        if previous is not None and (
            node.lineno == (previous.end_lineno or previous.lineno)
            or lines[node.lineno - 1][: node.col_offset].strip()
        ):
            return [g for g in groups if g]  # statements sharing a line: leave the layout alone
        gap = previous is None or any(
            not lines[i].strip() for i in range((previous.end_lineno or previous.lineno), node.lineno - 1)
        )
        if gap or not groups:
            groups.append([node])
        else:
            groups[-1].append(node)
        previous = node
        if end > len(lines):
            break
    return [g for g in groups if g]


def _guarded_imports(node: ast.stmt) -> bool:
    """A top-level ``try``/``if`` holding imports and nothing but imports, fallbacks and ``pass``."""
    if not isinstance(node, (ast.Try, ast.If)):
        return False
    handlers = [h.body for h in getattr(node, "handlers", [])]
    body = [s for block in [node.body, node.orelse, *handlers, getattr(node, "finalbody", [])] for s in block]
    allowed = (ast.Import, ast.ImportFrom, ast.Pass, ast.Assign, ast.AnnAssign)
    return any(isinstance(s, (ast.Import, ast.ImportFrom)) for s in node.body) and all(
        isinstance(s, allowed) for s in body
    )


def _key(node: ast.stmt) -> str:
    if isinstance(node, ast.Import):
        return node.names[0].name.lower()
    return (node.module or "").lower() if isinstance(node, ast.ImportFrom) else ""


def _sorted_position(group: list[ast.stmt], module: str, lines: list[str], leading: int) -> int:
    """1-based line before which ``import <module>`` goes in ``group`` (``leading``: see
    :func:`_above_comments`)."""
    plain = [n for n in group if isinstance(n, ast.Import)]
    froms = [n for n in group if isinstance(n, ast.ImportFrom)]
    imports_first = not plain or not froms or max(n.lineno for n in plain) < min(n.lineno for n in froms)
    candidates = plain if imports_first else group
    key = module.lower()
    for node in candidates:
        if _key(node) > key:
            return _above_comments(lines, node.lineno, leading)
    if imports_first and froms:
        return _above_comments(lines, froms[0].lineno, leading)
    last = group[-1]
    return (last.end_lineno or last.lineno) + 1


def _above_comments(lines: list[str], line: int, leading: int) -> int:
    """``line``, moved up over the comment lines directly above it (they belong to its statement),
    unless it is ``leading``, the first line of the file's first statement after the docstring and
    ``__future__`` imports: the comments above that one (shebang, encoding cookie, licence) head
    the file, and isort leaves them there."""
    if line == leading:
        return line
    while line > 1 and lines[line - 2].lstrip().startswith("#"):
        line -= 1
    return line
