"""Import management after rewrites, done as line splices on the new text.

* :func:`ensure_import` adds ``import flashport`` once, unguarded, after the module docstring and
  ``from __future__`` imports (flashport is always installed where rewritten code runs).
* :func:`remove_unused` drops imports from GPU-only modules (``flash_attn``) whose names a rewrite
  made unused. Imports under ``try``/``if``/``with`` (guards such as ``try: ... except ImportError``
  or ``if is_flash_attn_2_available():``) are never touched, and a name still used anywhere
  (feature probes like ``inspect.signature(flash_attn_func)``) keeps its import.
"""

from __future__ import annotations

import ast
import collections

import libcst as cst

from flashport.rewriter.source import split_lines

_SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def name_uses(tree: ast.AST) -> collections.Counter:
    """How often each name is read (``Name`` loads, plus strings listed in ``__all__``)."""
    uses: collections.Counter = collections.Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            uses[node.id] += 1
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            for elt in getattr(node.value, "elts", []):
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                    uses[elt.value] += 1
    return uses


def _bound_name(alias: ast.alias) -> str:
    return alias.asname or alias.name.split(".")[0]


def _unguarded_imports(tree: ast.Module):
    """Yield (import node, parent body) for imports whose ancestors are only module/def/class."""
    stack = [(tree, True)]
    while stack:
        node, clean = stack.pop()
        for field in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            for child in body:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if clean and field == "body":
                        yield child, body
                elif isinstance(child, ast.AST):
                    stack.append((child, clean and isinstance(child, _SCOPES)))


def _is_gpu(module: str, gpu_modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in gpu_modules)


def remove_unused(text: str, before: collections.Counter, gpu_modules: tuple[str, ...]) -> tuple[str, list[str]]:
    """Drop unguarded GPU imports whose bound names were used in ``before`` and are unused now.

    Returns the new text and the dotted names removed.
    """
    if not gpu_modules:
        return text, []
    tree = ast.parse(text)
    after = name_uses(tree)
    lines = split_lines(text)
    edits: list[tuple[int, int, str]] = []  # (start line, end line, replacement text)
    removed: list[str] = []
    for node, body in _unguarded_imports(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level or not _is_gpu(node.module or "", gpu_modules):
                continue
            drop = [a for a in node.names if a.name != "*" and before[_bound_name(a)] and not after[_bound_name(a)]]
            prefix = f"{node.module}."
        else:
            drop = [a for a in node.names if _is_gpu(a.name, gpu_modules) and before[_bound_name(a)] and not after[_bound_name(a)]]
            prefix = ""
        if not drop:
            continue
        start, end = node.lineno, node.end_lineno or node.lineno
        first, last = lines[start - 1], lines[end - 1]
        alone = first[: node.col_offset].strip() == "" and _only_comment(last.encode("utf-8")[node.end_col_offset :].decode("utf-8", "replace"))
        if not alone or any(other is not node and _overlaps(other, start, end) for other in body):
            continue
        if len(drop) == len(node.names):
            if len(body) == 1:
                continue  # the block would become empty
            edits.append((start, end, ""))
        else:
            new = _drop_aliases("".join(lines[start - 1 : end]), {a.asname or a.name for a in drop})
            if new is None:
                continue
            edits.append((start, end, new))
        removed.extend(prefix + a.name for a in drop)
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1 : end] = [new] if new else []
    return "".join(lines), removed


def _only_comment(rest: str) -> bool:
    rest = rest.strip()
    return not rest or rest.startswith("#")


def _overlaps(other: ast.stmt, start: int, end: int) -> bool:
    o_start, o_end = other.lineno, other.end_lineno or other.lineno
    return not (o_end < start or o_start > end)


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
                kept[-1] = kept[-1].with_changes(comma=_closing_comma(kept[-1].comma, updated.names[-1].comma))
            else:
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(names=kept)

        def leave_Import(self, original, updated):
            kept = [a for a in updated.names if (a.evaluated_alias or a.evaluated_name.split(".")[0]) not in names]
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
        return own.with_changes(whitespace_after=mine.with_changes(indent=theirs.indent, last_line=theirs.last_line))
    return last


def has_import(tree: ast.Module, module: str) -> bool:
    """True when the module has an unguarded top-level ``import <module>`` (or a submodule)."""
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is None and (alias.name == module or alias.name.startswith(module + ".")):
                    return True
    return False


def ensure_import(text: str, module: str, newline: str) -> tuple[str, bool]:
    """Add ``import <module>`` once; returns (text, added)."""
    tree = ast.parse(text)
    if has_import(tree, module):
        return text, False
    lines = split_lines(text)
    index = 0
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
        index = 1
    while index < len(body) and isinstance(body[index], ast.ImportFrom) and body[index].module == "__future__":
        index += 1
    statement = f"import {module}{newline}"
    if index < len(body) and isinstance(body[index], (ast.Import, ast.ImportFrom)):
        lines.insert(body[index].lineno - 1, statement)  # at the top of the import block
    elif index > 0:  # right after the docstring / __future__ imports
        last_line = body[index - 1].end_lineno or len(lines)
        if not lines[last_line - 1].endswith(("\n", "\r")):
            lines[last_line - 1] += newline
        lines.insert(last_line, statement)
    elif body:  # before the first statement (comments, shebang and coding line stay above)
        node = body[0]
        lines.insert(min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1, statement)
    else:
        if lines and not lines[-1].endswith(("\n", "\r")):
            lines[-1] += newline
        lines.append(statement)
    return "".join(lines), True
