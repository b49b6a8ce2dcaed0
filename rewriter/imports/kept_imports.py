"""Why a GPU import survived the import clean-up: one line per kept import, for the report.

The clean-up (:mod:`flashport.rewriter.imports.dead_imports`, :mod:`flashport.rewriter.imports.drop_in_imports`)
removes or re-points only what it can prove the file no longer needs from the GPU library; what it
keeps, it keeps for a reason the user should see next to the diff:

* a name still read as the GPU library's function (a site left as it was: refused, suppressed,
  or a use no rule covers);
* an availability probe: an import in a ``try`` whose names nothing reads, or a name only tested
  (``is None``) that the file never called - it asks about the real library, and pointing it at
  flashport would change the answer;
* a module read for itself (``flash_attn.__file__``, ``getattr(fa, "__version__")``): code that
  inspects the installed library, which has no flashport counterpart;
* a name read nowhere in the file (a possible re-export) that flashport's drop-ins do not
  replicate for the configured flash-attn release;
* a name whose every use was ported, in a ``try`` that stays (it holds other code or GPU imports
  still read), which still asks whether the library is installed; or in a statement that shares its
  line with other code.
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Callable

from flashport.rewriter.imports import drop_in_imports
from flashport.rewriter.source import astindex, semantic


def explain(
    tree: ast.Module,
    before: collections.Counter,
    after: collections.Counter,
    gpu_modules: tuple[str, ...],
    version: tuple[int, ...],
    line_of: Callable[[int], int] | None = None,
) -> list[str]:
    """``"<module> (line N): <reason>"`` for every GPU import left in the rewritten ``tree`` (N: its
    line there, or ``line_of(line)`` when imports were added to the text after ``tree`` was
    parsed), in line order.

    ``before``/``after``: name reads of the original and the rewritten file
    (:func:`flashport.rewriter.imports.edits.name_uses`); ``version``: the flash-attn release ported for.
    """
    probes = drop_in_imports.probe_reads(tree)
    in_try = {  # statements inside a try body, at any depth
        id(inner)
        for n in astindex.of_type(tree, ast.Try, ast.TryStar)
        if isinstance(n, (ast.Try, ast.TryStar))
        for s in n.body
        for inner in ast.walk(s)
    }
    out: list[tuple[int, str]] = []
    for node in astindex.of_type(tree, ast.Import, ast.ImportFrom):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.ImportFrom) and node.level
        ):
            continue
        for alias in node.names:
            if isinstance(node, ast.Import):
                module, shown = alias.name, alias.name
            else:
                module, shown = node.module or "", f"{node.module}.{alias.name}"
            if not any(module == m or module.startswith(m + ".") for m in gpu_modules):
                continue
            bound = alias.asname or alias.name.split(".")[0]
            if isinstance(node, ast.Import):
                why = _module_reason(bound, after, id(node) in in_try, tree)
            else:
                why = _name_reason(bound, (before, after, probes), id(node) in in_try, version)
            line = line_of(node.lineno) if line_of is not None else node.lineno
            out.append((line, f"{shown} (line {line}): {why}"))
    return [line for _, line in sorted(out)]


def _module_reason(bound, after, in_try, tree) -> str:
    if not after[bound]:
        return _unread(in_try, "the module")
    return (
        f"reads `{bound}` itself ({_how(bound, tree)}): it inspects the installed library, which has"
        " no flashport counterpart"
    )


def _name_reason(bound, counts, in_try, version) -> str:
    before, after, probes = counts
    if after[bound] and after[bound] == probes[bound]:
        if before[bound] == after[bound]:
            return f"`{bound}` is only tested (is None) and never called here: the probe asks about the real library"
        return f"`{bound}` is only tested (is None), but flashport has no drop-in of it"
    if after[bound]:
        return f"`{bound}` is still read ({after[bound]}x): a use left as it was (refused, suppressed or not covered)"
    if before[bound]:  # every use was ported: the statement it sits in is what stays
        if in_try:
            return (
                f"an availability probe: every use of `{bound}` was ported, but its try stays (it holds"
                " other code or GPU imports still read) and still answers whether the library is installed"
            )
        return f"every use of `{bound}` was ported, but its import shares a line with other code, which stays"
    if in_try:
        return _unread(True, f"`{bound}`")
    release = ".".join(map(str, version))
    return f"`{bound}` is read nowhere here (a re-export?): no flashport drop-in replicates it for flash-attn {release}"


def _unread(in_try: bool, what: str) -> str:
    if in_try:
        return (
            f"an availability probe: {what} is read nowhere, the try answers whether the library is installed"
        )
    return f"{what} is read nowhere here (imported for its side effects, or re-exported)"


def _how(bound: str, tree: ast.Module) -> str:
    """A few of the ways ``bound`` is read, as source text."""
    model = semantic.of(tree)
    seen: list[str] = []
    for node in model.loads(bound):
        parent = model.parent(node)
        text = ast.unparse(parent if isinstance(parent, (ast.Attribute, ast.Call)) else node)
        if text not in seen:
            seen.append(text if len(text) <= 40 else text[:37] + "...")
    return ", ".join(seen[:3])
