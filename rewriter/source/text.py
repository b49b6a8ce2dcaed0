"""Byte-faithful source handling: decoding, line splitting and top-level statement units.

The engine never re-renders a whole file. It decodes the bytes with the file's own encoding (PEP 263
cookie or BOM), splits lines keeping their endings (``\\r\\n``, ``\\r``, ``\\n``), and later splices
rewritten statement texts back in, so every byte outside a rewritten statement stays identical.
"""

from __future__ import annotations

import ast
import codecs
import dataclasses
import io
import re
import tokenize

from flashport.rewriter.source import semantic

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def decode(source: bytes) -> tuple[str, str]:
    """Return ``(text, encoding)``; ``encoding`` is ``utf-8-sig`` for a BOM so encode() restores it.

    Raises:
      SyntaxError: an unknown encoding cookie (from ``tokenize.detect_encoding``).
      UnicodeDecodeError: bytes that do not decode.
    """
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
    except SyntaxError as err:
        if "invalid or missing encoding declaration" not in str(err):
            raise
        # the first lines are not UTF-8: say where, below
        encoding = "utf-8-sig" if source.startswith(codecs.BOM_UTF8) else "utf-8"
    try:
        return source.decode(encoding), encoding
    except UnicodeDecodeError as err:
        declared = encoding == "utf-8-sig" or any(_COOKIE.match(line) for line in source.split(b"\n", 2)[:2])
        raise Undecodable(err, declared) from err


_COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=]")


class Undecodable(UnicodeDecodeError):
    """A :class:`UnicodeDecodeError` whose message says where, and what to do about a missing cookie."""

    def __init__(self, err: UnicodeDecodeError, declared: bool):
        super().__init__(err.encoding, err.object, err.start, err.end, err.reason)
        self.declared = declared

    def __str__(self) -> str:
        data = bytes(self.object)
        line = data.count(b"\n", 0, self.start) + 1
        column = self.start - (data.rfind(b"\n", 0, self.start) + 1)
        where = f"not valid {self.encoding} at line {line}, column {column} (byte 0x{data[self.start]:02x})"
        if self.declared:
            return where
        return (
            where + "; the file declares no encoding: add a `# -*- coding: NAME -*-` line if it is not UTF-8"
        )


_FOREIGN_BOMS = (  # longest first: the UTF-32-LE mark starts with the UTF-16-LE one
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def foreign_encoding(source: bytes) -> str | None:
    """Why ``source`` cannot be a Python file, for a UTF-16/32 byte-order mark (Python reads only
    ASCII-compatible encodings, and the engine's byte prefilter would not see its text); else None."""
    for bom, name in _FOREIGN_BOMS:
        if source.startswith(bom):
            return (
                f"encoded as {name} (byte-order mark); Python source must use an ASCII-compatible "
                "encoding such as UTF-8, so the file is left untouched"
            )
    return None


def encode(text: str, encoding: str) -> bytes:
    """Inverse of :func:`decode`."""
    return text.encode(encoding)


def split_lines(text: str) -> list[str]:
    """Lines with their endings; ``"".join(split_lines(t)) == t`` always."""
    return _LINE.findall(text)


def newline_of(lines: list[str]) -> str:
    """The file's first line ending (``"\\n"`` when it has none)."""
    for line in lines:
        if line.endswith("\r\n"):
            return "\r\n"
        if line.endswith(("\n", "\r")):
            return line[-1]
    return "\n"


@dataclasses.dataclass(frozen=True, eq=False)
class Unit:
    """A run of top-level statements that share lines (usually exactly one statement).

    Attributes:
      start, end: 1-based inclusive line range (decorators included).
      nodes: the ast statements.
      importish: True for imports and for try/if/with blocks that contain imports (these form the
        header that lets libcst resolve names inside a chunk).
    """

    start: int
    end: int
    nodes: tuple[ast.stmt, ...]
    importish: bool
    in_class: bool = False
    parent: Unit | None = None


def first_line(stmt: ast.stmt) -> int:
    """The 1-based first line of a statement, its decorators included."""
    return min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])


def top_level_units(tree: ast.Module) -> list[Unit]:
    """Group the module's statements into line-disjoint :class:`Unit` s."""
    # top-level statements holding an import that runs at module level (not in a def or class)
    holding = {id(b.top) for b in semantic.of(tree).imports if not b.scopes}
    return _group(tree.body, holding)


def class_body_units(unit: Unit) -> list[Unit] | None:
    """The statements of a top-level class as units (``in_class``), or None if ``unit`` is not one
    plain class."""
    if len(unit.nodes) != 1 or not isinstance(unit.nodes[0], ast.ClassDef):
        return None
    return [dataclasses.replace(u, importish=False, in_class=True) for u in _group(unit.nodes[0].body, set())]


def _group(body: list[ast.stmt], holding: set[int]) -> list[Unit]:
    """``body`` as line-disjoint units; ``holding``: ids of the statements that hold an import
    outside any def or class (a ``try``/``if``/``with`` among them is importish)."""
    units: list[Unit] = []
    for stmt in body:
        start = first_line(stmt)
        end = stmt.end_lineno or stmt.lineno
        importish = semantic.is_import(stmt) or (
            isinstance(stmt, (ast.Try, ast.If, ast.With)) and id(stmt) in holding
        )
        if units and start <= units[-1].end:
            last = units.pop()
            units.append(
                Unit(last.start, max(end, last.end), last.nodes + (stmt,), last.importish and importish)
            )
        else:
            units.append(Unit(start, end, (stmt,), importish))
    return units


def unit_text(lines: list[str], unit: Unit) -> str:
    """The unit's lines, joined (endings kept)."""
    return "".join(lines[unit.start - 1 : unit.end])
