"""``ast.parse`` of an edited file, reparsing only the top-level statements the edits touch.

The engine parses a big file three times: the original, the text after the rules' edits and the
text after the import clean-up. The two later texts differ from the one before in a few whole-line
edits, so their trees are the earlier tree with the touched top-level statements parsed again and
the others moved by the lines the edits added or removed, which costs a fraction of a parse of
the whole file. :func:`reparse` returns a tree equal to ``ast.parse`` of the new text, positions
included (tests compare the dumps); the engine's reference mode parses the whole text instead.
"""

from __future__ import annotations

import ast
import bisect
import itertools
from collections import deque
from collections.abc import Sequence

from flashport.rewriter.source.text import first_line, split_lines

# An edit: lines first..last (1-based, inclusive) of the old text became ``count`` new lines.
Edit = tuple[int, int, int]


def line_edits(replacements: Sequence[tuple[int, int, str]]) -> list[Edit]:
    """The :data:`Edit` of each ``(first, last, new text)`` replacement of whole lines."""
    return [(first, last, len(split_lines(text))) for first, last, text in replacements]


def reparse(tree: ast.Module, old_line_count: int, new_text: str, edits: Sequence[Edit]) -> ast.Module:
    """``ast.parse(new_text)``, where ``new_text`` is the source of ``tree`` (``old_line_count``
    lines) with the disjoint whole-line ``edits`` applied.

    The top-level statements of ``tree`` that no edit touches are reused with their positions
    moved in place (``tree`` must not be used afterwards); the rest of the text is parsed again.
    Where the pieces cannot be placed or parsed alone, the whole text is parsed.

    Raises:
      SyntaxError: as ``ast.parse(new_text)`` would.
    """
    edits = sorted(edits)
    if not edits:
        return tree
    body = tree.body
    spans = [(first_line(node), node.end_lineno or node.lineno) for node in body]
    overlapping = any(a[1] >= b[0] for a, b in itertools.pairwise(edits))
    shared = any(a[1] >= b[0] for a, b in itertools.pairwise(spans))  # `a = 1; b = 2`
    if overlapping or shared or edits[-1][1] > old_line_count:
        return ast.parse(new_text)
    new_lines = split_lines(new_text)
    starts = [first for first, _, _ in edits]
    deltas = [0]  # lines added by the edits before each one
    for first, last, count in edits:
        deltas.append(deltas[-1] + count - (last - first + 1))
    if old_line_count + deltas[-1] != len(new_lines):
        return ast.parse(new_text)  # the edits do not describe the text (an edit's text ran on)

    def moved(line: int) -> int:
        """The new number of an old line that no edit touches."""
        return line + deltas[bisect.bisect_right(starts, line)]

    new_body: list[ast.stmt] = []
    at = 0  # the next statement of ``body`` to place
    try:
        for first, last in _regions(spans, edits):
            while at < len(body) and spans[at][1] < first:
                _shift(body[at], moved(spans[at][0]) - spans[at][0])
                new_body.append(body[at])
                at += 1
            while at < len(body) and spans[at][0] <= last:
                at += 1  # reparsed below
            start = moved(first - 1) + 1 if first > 1 else 1
            end = moved(last + 1) - 1 if last < old_line_count else len(new_lines)
            piece = ast.parse("".join(new_lines[start - 1 : end]))
            for node in piece.body:
                _shift(node, start - 1)
            new_body.extend(piece.body)
    except SyntaxError:
        return ast.parse(new_text)  # the edits' text runs into untouched lines: no piece stands alone
    for node, (line, _) in zip(body[at:], spans[at:], strict=True):
        _shift(node, moved(line) - line)
        new_body.append(node)
    return ast.Module(body=new_body, type_ignores=[])


def _regions(spans: list[tuple[int, int]], edits: list[Edit]) -> list[tuple[int, int]]:
    """Old line ranges to parse again: each edit with the statements it overlaps, merged where they
    overlap or touch (so the lines just outside a range are lines no edit changed)."""
    firsts = [first for first, _ in spans]
    ranges = []
    for first, last, _ in edits:
        lo, hi = first, last
        i = max(bisect.bisect_right(firsts, last) - 1, 0)
        while i >= 0 and spans and spans[i][1] >= first:
            if spans[i][0] <= last:
                lo, hi = min(lo, spans[i][0]), max(hi, spans[i][1])
            i -= 1
        ranges.append((lo, hi))
    ranges.sort()
    merged = [ranges[0]]
    for lo, hi in ranges[1:]:
        if lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _shift(node: ast.AST, lines: int) -> None:
    """Move ``node`` and everything under it down by ``lines`` (in place; no-op for 0)."""
    if not lines:
        return
    todo = deque([node])
    pop, push, node_type = todo.pop, todo.append, ast.AST
    while todo:
        item = pop()
        if "lineno" in item._attributes:
            line = getattr(item, "lineno", None)
            if line is not None:
                setattr(item, "lineno", line + lines)  # noqa: B010 - ast.AST declares no positions
            end = getattr(item, "end_lineno", None)
            if end is not None:
                setattr(item, "end_lineno", end + lines)  # noqa: B010
        for name in item._fields:
            value = getattr(item, name, None)
            if isinstance(value, node_type):
                push(value)
            elif isinstance(value, list):
                for child in value:
                    if isinstance(child, node_type):
                        push(child)
