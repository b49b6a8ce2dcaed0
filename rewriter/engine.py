"""The per-file transform: bytes in, :class:`~flashport.rewriter.results.FileResult` out.

Pipeline for one file (pure: no I/O besides the optional read in :func:`transform_file`):

1. **Byte prefilter**: the enabled rules' ``TRIGGERS`` as one bytes regex. A file without a match is
   never decoded or parsed.
2. Decode with the file's own encoding (cookie/BOM), ``ast.parse`` for syntax checking and for
   top-level statement boundaries (C parser: cheap).
3. For every top-level statement that mentions a trigger (imports aside), build a mini module
   (header imports + that statement) and run :class:`~flashport.rewriter.transform.SiteTransformer`
   with libcst's ``QualifiedNameProvider``: rules answer per site.
4. Splice rewritten statement texts into the original lines (everything else is byte-identical),
   drop GPU imports a rewrite made unused, add ``import flashport`` once.
5. The new text must parse and compile, or the file is reported as an error and left alone.

Rules are instantiated afresh for every file.
"""

from __future__ import annotations

import ast
import re
import traceback
from typing import Iterable, Sequence

import libcst as cst
from libcst.metadata import MetadataWrapper

from flashport.rewriter import imports as import_edits
from flashport.rewriter import source as src
from flashport.rewriter import suppress
from flashport.rewriter.results import CHANGED, ERROR, UNCHANGED, FileResult
from flashport.rewriter.transform import SiteTransformer
from flashport.rules.base import Rule, RuleOptions


def trigger_pattern(rules: Iterable[type[Rule]]) -> re.Pattern[bytes]:
    """One bytes regex matching any trigger of ``rules`` (matches nothing when there are none)."""
    triggers = sorted({t for rule in rules for t in rule.TRIGGERS})
    if not triggers:
        return re.compile(rb"(?!x)x")
    return re.compile(b"|".join(re.escape(t) for t in triggers))


def transform_file(path: str, rules: Sequence[type[Rule]], options: RuleOptions, pattern=None) -> FileResult:
    """Read ``path`` and run :func:`transform_source` (read errors become error results)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as err:
        return FileResult(path, ERROR, error=f"cannot read: {err.strerror or err}")
    return transform_source(data, path, rules, options, pattern)


def transform_source(
    data: bytes,
    path: str,
    rules: Sequence[type[Rule]],
    options: RuleOptions | None = None,
    pattern: re.Pattern[bytes] | None = None,
) -> FileResult:
    """Find and rewrite GPU attention sites in one file's bytes.

    Args:
      data: the file's bytes.
      path: used in findings and messages.
      rules: rule classes to apply (instantiated fresh here).
      options: :class:`RuleOptions`.
      pattern: a precompiled :func:`trigger_pattern` (computed when omitted).

    Returns:
      A :class:`FileResult`; ``new`` holds the rewritten bytes when something changed.
    """
    options = options or RuleOptions()
    pattern = pattern or trigger_pattern(rules)
    result = FileResult(path, size=len(data))
    if not pattern.search(data):
        return result
    result.parsed = True
    try:
        text, encoding = src.decode(data)
    except (SyntaxError, UnicodeDecodeError, LookupError) as err:
        return _error(result, f"cannot decode: {err}")
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as err:
        return _error(result, f"syntax error at line {err.lineno}: {err.msg}")
    except (ValueError, RecursionError, MemoryError) as err:
        return _error(result, f"cannot parse: {err}")
    try:
        return _transform(result, data, text, encoding, tree, [rule() for rule in rules], options)
    except Exception as err:  # noqa: BLE001 - one bad file must not stop a run
        detail = traceback.format_exception_only(type(err), err)[-1].strip()
        return _error(result, f"internal error, file left unchanged: {detail}")


def _error(result: FileResult, message: str) -> FileResult:
    result.status = ERROR
    result.error = message
    return result


def _transform(result, data, text, encoding, tree, rules, options) -> FileResult:
    lines = src.split_lines(text)
    text_pattern = re.compile("|".join(re.escape(t.decode("utf-8")) for r in rules for t in r.TRIGGERS) or "(?!x)x")
    units = src.top_level_units(tree)
    header_units = [u for u in units if u.importish]
    table = suppress.parse(lines)
    replacements: list[tuple[int, int, str]] = []
    needed: set[str] = set()
    gpu_modules = tuple(sorted({m for r in rules for m in r.GPU_MODULES}))
    for unit in units:
        chunk = src.unit_text(lines, unit)
        if not text_pattern.search(chunk):
            continue
        if unit.importish and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in unit.nodes):
            continue
        header = "".join(_terminated(src.unit_text(lines, h)) for h in header_units if h is not unit)
        header_lines = len(src.split_lines(header))
        body = _terminated(chunk)
        module = cst.parse_module(header + body)
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        transformer = SiteTransformer(rules, options, result.path, header_lines, unit.start, table, module)
        new_module = wrapper.visit(transformer)
        result.sites.extend(transformer.sites)
        if transformer.rewrites:
            new_code = new_module.code
            if not new_code.startswith(header):
                raise RuntimeError("rewrite touched the import header")
            new_chunk = new_code[len(header) :]
            if body is not chunk and new_chunk.endswith(body[len(chunk) :]):
                new_chunk = new_chunk[: len(new_chunk) - (len(body) - len(chunk))]
            if new_chunk != chunk:
                replacements.append((unit.start, unit.end, new_chunk))
                needed.update(transformer.imports)
    result.sites.sort(key=lambda s: (s.line, s.column, s.rule))
    if not replacements:
        return result
    for start, end, new_chunk in sorted(replacements, reverse=True):
        lines[start - 1 : end] = [new_chunk]
    new_text = "".join(lines)
    before = import_edits.name_uses(tree)
    new_text, removed = import_edits.remove_unused(new_text, before, gpu_modules)
    newline = src.newline_of(src.split_lines(text))
    for module_name in sorted(needed):
        new_text, added = import_edits.ensure_import(new_text, module_name, newline)
        if added:
            result.imports_added.append(module_name)
    result.imports_removed = removed
    compile(new_text, result.path, "exec", dont_inherit=True)  # the guarantee: output compiles
    new_data = src.encode(new_text, encoding)
    if new_data != data:
        result.status = CHANGED
        result.old = data
        result.new = new_data
    return result


def _terminated(chunk: str) -> str:
    """``chunk`` ending with a newline (a file's last line may lack one)."""
    return chunk if chunk.endswith(("\n", "\r")) else chunk + "\n"
