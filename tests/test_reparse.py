"""rewriter/source/reparse: the tree of an edited file from the touched statements equals
``ast.parse`` of the whole new text, positions included."""

from __future__ import annotations

import ast
import functools
import pathlib
import random
import zlib

import pytest

from flashport.rewriter.source import reparse
from flashport.rewriter.source.text import split_lines

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for p in (ROOT / "tests" / "fixtures").rglob("*.py")) + sorted(
    (ROOT / "examples").rglob("*.py")
)


def _dump_or_error(parse, text):
    try:
        return ast.dump(parse(text), include_attributes=True)
    except SyntaxError as err:
        return f"SyntaxError {err.lineno}"


def _reparse(text, line_count, edits, new_text):
    return reparse.reparse(ast.parse(text), line_count, new_text, edits)


def _apply(lines, replacements):
    new = list(lines)
    for first, last, text in sorted(replacements, reverse=True):
        new[first - 1 : last] = split_lines(text)
    return "".join(new)


def _random_edits(lines, rng):
    """Disjoint whole-line edits of the kinds the engine makes: a range deleted, kept, grown by
    lines (inside a statement or between two), or replaced by a statement."""
    cuts = sorted(rng.sample(range(1, len(lines) + 1), min(len(lines), 2 * rng.randint(1, 3))))
    edits = []
    for first, last in zip(cuts[::2], cuts[1::2], strict=False):
        old = "".join(lines[first - 1 : last])
        kind = rng.randrange(5)
        text = ["", old, old.replace("\n", "\n\n", 1), old + "# added\n", "import flashport\n"][kind]
        edits.append((first, last, text))
    return edits


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_reparse_equals_a_whole_parse(path):
    text = path.read_text(encoding="utf-8")
    lines = split_lines(text)
    rng = random.Random(zlib.crc32(str(path.relative_to(ROOT)).encode()))
    parsed = 0
    for _ in range(12):
        replacements = _random_edits(lines, rng)
        new_text = _apply(lines, replacements)
        want = _dump_or_error(ast.parse, new_text)
        edits = reparse.line_edits(replacements)
        got = _dump_or_error(functools.partial(_reparse, text, len(lines), edits), new_text)
        assert got == want, replacements
        parsed += not want.startswith("SyntaxError")
    assert parsed, "no edit kept the file valid: the case tests nothing"


def test_reparse_parses_only_the_touched_statements(monkeypatch):
    text = "import a\n\n\ndef f():\n    return 1\n\n\nx = [\n    1,\n]\n\n\ndef g():\n    pass\n"
    lines = split_lines(text)
    tree = ast.parse(text)
    calls = []
    real = ast.parse
    monkeypatch.setattr(reparse.ast, "parse", lambda source: calls.append(source) or real(source))
    replacements = [(1, 1, ""), (9, 9, "    1,\n    2,\n")]
    new_text = _apply(lines, replacements)
    got = reparse.reparse(tree, len(lines), new_text, reparse.line_edits(replacements))
    assert ast.dump(got, include_attributes=True) == ast.dump(real(new_text), include_attributes=True)
    assert calls == ["", "x = [\n    1,\n    2,\n]\n"]  # f and g moved, not parsed


def test_edits_that_do_not_describe_the_text_parse_it_whole():
    text = "a = 1\nb = 2\nc = 3\n"
    tree = ast.parse(text)
    new_text = "a = 1\nb = (\n 2)\nc = 3\n"
    got = reparse.reparse(tree, 3, new_text, [(2, 2, 1)])  # says one line, the text has two
    assert ast.dump(got, include_attributes=True) == ast.dump(ast.parse(new_text), include_attributes=True)
