"""Files written for a newer Python than the host's: let the ``ast``-based stages analyse them.

The engine uses the host's ``ast`` for statement boundaries, pruning and import edits, and libcst
for the rewrite. libcst's own parser reads Python 3.12+ syntax on any host, but ``ast`` on 3.11
rejects ``type X = ...`` statements and PEP 701 f-strings (``f"{"a" + b}"``). :func:`mask` swaps
each such construct for a placeholder the host can parse, with the same line count and the same
names used (so import analysis still counts them); :func:`unmask` puts the original text back into
the rewritten file. Constructs without a placeholder (e.g. ``def f[T]()``) leave the masked text
unparseable, and the engine reports the file with the reason.
"""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

PREFIX = "__flashport_newer_syntax_"


def mask(text: str) -> tuple[str, dict[str, str]] | None:
    """``(masked text, placeholder -> original text)``, or None when libcst cannot parse ``text``."""
    try:
        wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
    except (cst.ParserSyntaxError, RecursionError, ValueError):
        return None
    positions = wrapper.resolve(PositionProvider)
    finder = _Finder()
    wrapper.module.visit(finder)
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def offset(position) -> int:
        return starts[position.line - 1] + position.column

    spans: list[tuple[int, int, str, str, str]] = []
    for node, statement in finder.found:
        where = positions[node]
        start, end = offset(where.start), offset(where.end)
        original = text[start:end]
        names = ", ".join(sorted(finder.names_in(node)))
        key = f"{PREFIX}{len(spans)}__"
        filler = "\n" * original.count("\n")
        if statement:
            placeholder = f"{key} = ({names}{',' if names else 'None'}{filler})"
        else:
            placeholder = f"({key}, {names}{filler})" if names else f"({key}{filler})"
        spans.append((start, end, key, placeholder, original))
    if not spans:
        return text, {}
    pieces, table, last = [], {}, 0
    for start, end, _key, placeholder, original in spans:
        pieces.append(text[last:start])
        pieces.append(placeholder)
        table[placeholder] = original
        last = end
    pieces.append(text[last:])
    return "".join(pieces), table


def unmask(text: str, table: dict[str, str]) -> str:
    """Put the original constructs back (``table`` from :func:`mask`).

    Raises:
      ValueError: when a rewrite changed a placeholder (the original text cannot be restored).
    """
    for placeholder, original in table.items():
        if text.count(placeholder) != 1:
            raise ValueError("a rewrite touched Python 3.12+ syntax that this host's Python cannot analyse")
        text = text.replace(placeholder, original)
    return text


def _parses_here(code: str, mode: str) -> bool:
    try:
        ast.parse(code, mode=mode)
    except (SyntaxError, ValueError):
        return False
    return True


class _Finder(cst.CSTVisitor):
    """Outermost ``type`` statements and f-strings the host's ``ast`` cannot parse, in source order."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[cst.CSTNode, bool]] = []

    def visit_TypeAlias(self, node: cst.TypeAlias) -> bool:
        self.found.append((node, True))
        return False

    def visit_FormattedString(self, node: cst.FormattedString) -> bool:
        if _parses_here(cst.Module(body=[]).code_for_node(node), "eval"):
            return False
        self.found.append((node, False))
        return False

    @staticmethod
    def names_in(node: cst.CSTNode) -> set[str]:
        """Every name read inside ``node`` (kept in the placeholder for import analysis)."""
        names: set[str] = set()

        class _Names(cst.CSTVisitor):
            def visit_Name(self, name: cst.Name) -> None:
                names.add(name.value)

            def visit_Attribute(self, attribute: cst.Attribute) -> bool:
                attribute.value.visit(self)
                return False

        node.visit(_Names())
        if isinstance(node, cst.TypeAlias):
            names.discard(node.name.value)
            for parameter in node.type_parameters.params if node.type_parameters else ():
                names.discard(getattr(parameter.param, "name", cst.Name("_")).value)
        return names
