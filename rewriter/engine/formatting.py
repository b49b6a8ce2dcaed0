"""Formatting of the statements a rewrite changed, the way the project's formatter would: ruff's
range formatting (``ruff format --range``, black-compatible) over each changed block, with the
project's line length (``[tool.ruff]`` or ``[tool.black]`` ``line-length`` of the nearest
pyproject.toml / ruff.toml, default 88).

ruff is used when it is installed (the ``ruff`` package or a ``ruff`` on PATH); it is not a
dependency: without it the rewritten statements stay as the rules generated them. Lines the rewrite
did not change are never reformatted: a block whose formatting would touch any other line (ruff
extends a range to the whole enclosing statement, and re-indents a block indented other than it
would) is kept as generated, as is a block ruff cannot format.
"""

from __future__ import annotations

import ast
import difflib
import functools
import os
import shutil
import subprocess
import textwrap
import tomllib

from flashport.rewriter.source import semantic
from flashport.rewriter.source import text as src

DEFAULT_LINE_LENGTH = 88  # black's and ruff's default


@functools.cache
def ruff_binary() -> str | None:
    """The ruff executable (from the ``ruff`` package, else PATH), or None."""
    try:
        from ruff.__main__ import find_ruff_bin

        return os.fsdecode(find_ruff_bin())
    except (ImportError, FileNotFoundError):
        return shutil.which("ruff")


def line_length(path: str) -> int:
    """The line length of the project ``path`` belongs to: ``line-length`` from the nearest
    ruff.toml/.ruff.toml, or pyproject.toml's ``[tool.ruff]`` then ``[tool.black]``; else 88."""
    return _line_length_in(os.path.dirname(os.path.abspath(path)))


@functools.cache
def _line_length_in(directory: str) -> int:
    for name in ("ruff.toml", ".ruff.toml", "pyproject.toml"):
        table = _toml(os.path.join(directory, name))
        if table is None:
            continue
        if name != "pyproject.toml":
            return int(table.get("line-length", DEFAULT_LINE_LENGTH))
        tools = table.get("tool", {})
        for tool in ("ruff", "black"):
            value = tools.get(tool, {}).get("line-length")
            if isinstance(value, int):
                return value
        if "ruff" in tools or "black" in tools:
            return DEFAULT_LINE_LENGTH
    parent = os.path.dirname(directory)
    return DEFAULT_LINE_LENGTH if parent == directory else _line_length_in(parent)


def _toml(path: str) -> dict | None:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError):
        return None


def format_changed(path: str, old: str, new: str) -> str:
    """``new`` with each block of lines that differs from ``old`` formatted by ruff (bottom-up, so
    the line numbers of the blocks above stay valid); ``new`` itself when ruff is absent."""
    binary = ruff_binary()
    if binary is None:
        return new
    length = line_length(path)
    before = src.split_lines(old)
    lines = src.split_lines(new)
    matcher = difflib.SequenceMatcher(None, before, lines, autojunk=False)
    blocks = [(j1, j2) for tag, _i1, _i2, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert")]
    for start, end in reversed(_whole_statements(new, blocks)):
        if not _left_as_written(lines[start:end]):
            lines = _format_block(binary, path, lines, start, end, length)
    return "".join(lines)


_PRAGMAS = ("# noqa", "# type:", "# pragma", "# pylint:", "# flashport:", "# fmt:")


def _left_as_written(block: list[str]) -> bool:
    """Whether a changed block stays as the import edits or the rule wrote it: import statements
    (their layout is the project's isort's business) and lines carrying a pragma comment, which
    means something only on its own line (a wrap would move ``# noqa`` away from what it silences)."""
    if any(pragma in line for line in block for pragma in _PRAGMAS):
        return True
    try:
        tree = ast.parse(textwrap.dedent("".join(block)))
    except SyntaxError:
        return False
    return bool(tree.body) and all(semantic.is_import(node) for node in tree.body)


def _whole_statements(text: str, blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``blocks`` (0-based line ranges, end exclusive) grown to whole simple statements, or to the
    whole header of a compound statement, and merged where they then overlap."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return blocks
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or node.end_lineno is None:
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            spans.append((first - 1, body[0].lineno - 1))  # the header (a one-line body shares it)
        else:
            spans.append((node.lineno - 1, node.end_lineno))
    grown: list[tuple[int, int]] = []
    for start, end in blocks:
        for first, last in spans:
            if first < max(end, start + 1) and start < last:
                start, end = min(start, first), max(end, last)
        if grown and start < grown[-1][1]:
            start, end = grown[-1][0], max(end, grown.pop()[1])
        grown.append((start, end))
    return grown


def _format_block(binary: str, path: str, lines: list[str], start: int, end: int, length: int) -> list[str]:
    """``lines`` with lines ``start:end`` (0-based, end exclusive) formatted, when ruff changes no
    other line; else ``lines`` unchanged."""
    text = "".join(lines)
    command = [
        binary,
        "format",
        "--quiet",
        "--line-length",
        str(length),
        "--range",
        f"{start + 1}:1-{end}:{len(lines[end - 1].rstrip(chr(10) + chr(13))) + 1}",
        "--stdin-filename",
        path,
        "-",
    ]
    for extra in ([], ["--isolated"]):  # a project config this ruff cannot read: ruff's defaults
        try:
            done = subprocess.run(
                command[:2] + extra + command[2:], input=text, capture_output=True, text=True
            )
        except OSError:
            return lines
        if done.returncode == 0:
            break
    else:
        return lines
    formatted = src.split_lines(done.stdout)
    tail = len(lines) - end
    if formatted[:start] != lines[:start] or (tail and formatted[-tail:] != lines[-tail:]):
        return lines  # the formatter reached lines the rewrite did not change
    if len(formatted) - tail < start:
        return lines
    return formatted
