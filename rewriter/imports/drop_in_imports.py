"""GPU imports a port can point at flashport's drop-ins, and flash-attn version reads it can pin.

Two things keep a GPU import alive in a file whose every site was ported, though nothing in the file
needs the GPU library any more:

* **Names only probed or never read.** ``if _flash_attn_forward is None: raise ImportError(...)``
  after every call of ``_flash_attn_forward`` was ported, or ``from flash_attn import
  flash_attn_func`` that nothing in the file reads (a re-export: another module may import it from
  here, and the rest of the package is out of sight). :func:`target` names the drop-in module
  (:data:`DROP_INS`) that provides the same name, and the import is re-pointed there: the probe
  then finds the function flashport's port calls, and a re-export hands out the drop-in, which
  replicates the API. A never-read name moves only where the drop-in replicates every release the
  port was written for (not the private kernels, whose conventions changed between releases, nor
  ``unpad_input`` before 2.7), and never from the body of a ``try``: there an import whose names
  nothing reads *is* the probe ("is flash-attn installed?"), and pointing it at flashport would
  change the answer.
* **A version read.** ``flash_attn_version = version.parse(flash_attn.__version__)`` choosing
  between per-release call conventions that were all ported (FPA008 ports each branch for the
  releases its test admits). :func:`pin_versions` replaces each ``flash_attn.__version__`` by the
  release the port was written for (``--flash-attn-version``), so ``import flash_attn`` becomes
  dead - only when ``flash_attn`` is read for nothing but its ``__version__`` and every other GPU
  import of the file goes or moves (a live one may depend on the version the host really has).
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Callable

from flashport.rewriter.source import astindex
from flashport.rewriter.source.text import split_lines
from flashport.rules.apis.flash_attn import PRIVATE_FUNCTIONS
from flashport.rules.common.values import (
    BERT_PADDING,
    FA1_NAMES,
    FA2,
    FA2_NAMES,
    FA2_SIGNATURE,
    PADDING_NAMES,
    SEQUSED,
)

_PRIVATE = frozenset(PRIVATE_FUNCTIONS)
_PADDING = frozenset(PADDING_NAMES) - {"rearrange"}  # einops' function: an import of it stays
# GPU module -> (drop-in module, the names it provides under the same name and signature)
DROP_INS: dict[str, tuple[str, frozenset[str]]] = {
    "flash_attn": (FA2, frozenset(FA2_NAMES)),
    "flash_attn.flash_attn_interface": (FA2, frozenset(FA2_NAMES + FA1_NAMES) | _PRIVATE),
    "flash_attn.bert_padding": (BERT_PADDING, _PADDING),
}


def branch_target(module: str, name: str, version: tuple[int, ...]) -> str | None:
    """The drop-in module that can stand in for ``from <module> import <name>`` in one branch of
    an if/else that binds the name to another library in the other branch (the engine's branch
    port): the module's drop-ins replicate the function for calls and values alike (``rearrange``
    is einops' own, which the drop-in calls), not the private kernels, nor ``unpad_input`` before
    flash-attn 2.7 (four results, the drop-in's five). None when there is none."""
    drop_in, names = DROP_INS.get(module, ("", frozenset()))
    if module == "flash_attn.bert_padding":
        names = names | {"rearrange"}
    if name not in names or name in _PRIVATE:
        return None
    padded = tuple(version) + (0,) * (3 - len(version))
    if name == "unpad_input" and padded < (*SEQUSED, 0):
        return None
    return drop_in


def branch_module(
    node: ast.stmt, imported: list[str], version: tuple[int, ...], compared: Callable[[str], bool]
) -> str | None:
    """The drop-in module the one-line ``from m import a, b`` statement ``node`` can import from
    instead (the engine's branch port): every name has the same drop-in (:func:`branch_target`), is
    imported only there (``imported``: the qualified name of every import binding of the file) and
    is compared nowhere (``compared(bound name)``: the drop-in is another object). None otherwise."""
    if not isinstance(node, ast.ImportFrom) or node.level or node.lineno != node.end_lineno:
        return None
    module = ""
    for alias in node.names:
        if imported.count(f"{node.module}.{alias.name}") != 1 or compared(alias.asname or alias.name):
            return None
        target = branch_target(node.module or "", alias.name, version)
        if target is None or (module and target != module):
            return None
        module = target
    return module or None


def from_import_names(node: ast.stmt) -> tuple[str, list[tuple[str, str | None]]]:
    """``(module, [(name, asname), ...])`` of a ``from`` import statement (``("", [])`` for another)."""
    if not isinstance(node, ast.ImportFrom):
        return "", []
    return node.module or "", [(a.name, a.asname) for a in node.names]


def probe_reads(tree: ast.AST) -> collections.Counter:
    """How often each name is read only to test whether it is there: ``name is None`` / ``is not
    None``, or its truth in an ``if``/``while``/``assert`` test (through ``not``, ``and``, ``or``)."""
    probes: collections.Counter = collections.Counter()
    for node in astindex.of_type(tree, ast.Compare, ast.If, ast.While, ast.IfExp, ast.Assert):
        if isinstance(node, ast.Compare):
            if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
                pair = (node.left, node.comparators[0])
                for this, other in (pair, pair[::-1]):
                    if isinstance(this, ast.Name) and isinstance(other, ast.Constant) and other.value is None:
                        probes[this.id] += 1
            continue
        tests = [node.test]  # type: ignore[attr-defined]
        while tests:
            test = tests.pop()
            if isinstance(test, ast.Name):
                probes[test.id] += 1
            elif isinstance(test, ast.BoolOp):
                tests.extend(test.values)
            elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                tests.append(test.operand)
    return probes


def target(
    module: str,
    name: str,
    bound: str,
    before: collections.Counter,
    after: collections.Counter,
    probes: collections.Counter,
    exports: collections.Counter,
    in_try: bool,
    version: tuple[int, ...],
) -> str | None:
    """The drop-in module an import of ``name`` (bound as ``bound``) from GPU ``module`` can come
    from instead, or None (module doc). ``before``/``after``: name reads of the original and the
    rewritten file; ``probes``: :func:`probe_reads` of the rewritten one; ``exports``: its
    ``__all__`` entries; ``in_try``: the import sits directly in the body of a ``try``."""
    drop_in, names = DROP_INS.get(module, ("", frozenset()))
    if name not in names:
        return None
    if after[bound] and after[bound] == probes[bound] and before[bound] > after[bound]:
        return drop_in  # its uses were ported; what is left only asks whether it is there
    if not before[bound] == after[bound] == exports[bound] or in_try or name in _PRIVATE:
        return None
    padded = tuple(version) + (0,) * (3 - len(version))
    floor = SEQUSED if name == "unpad_input" else FA2_SIGNATURE
    return drop_in if padded >= (*floor, 0) else None


def exported(tree: ast.AST) -> collections.Counter:
    """The names listed in ``__all__`` (as :func:`flashport.rewriter.imports.edits.name_uses` counts them)."""
    names: collections.Counter = collections.Counter()
    for node in astindex.of_type(tree, ast.Assign):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            for elt in getattr(node.value, "elts", []):
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                    names[elt.value] += 1
    return names


def pin_versions(
    text: str,
    tree: ast.Module,
    before: collections.Counter,
    after: collections.Counter,
    gpu_modules: tuple[str, ...],
    version: tuple[int, ...],
) -> str:
    """``text`` with every ``flash_attn.__version__`` read replaced by the release the port was
    written for, where that makes ``import flash_attn`` dead (module doc); else ``text`` itself."""
    imports = [
        n
        for n in astindex.of_type(tree, ast.Import, ast.ImportFrom)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    ]
    bound = {
        a.asname or a.name
        for n in imports
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name == "flash_attn"
    }
    if len(bound) != 1:
        return text
    (name,) = bound
    reads = sum(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        for n in astindex.of_type(tree, ast.Name)
    )
    spans = [
        n
        for n in astindex.of_type(tree, ast.Attribute)
        if isinstance(n, ast.Attribute)
        and n.attr == "__version__"
        and isinstance(n.value, ast.Name)
        and n.value.id == name
        and isinstance(n.ctx, ast.Load)
        and n.lineno == n.end_lineno
    ]
    if not reads or not before[name] or len(spans) != reads:
        return text
    probes, exports = probe_reads(tree), exported(tree)
    for node in imports:
        if not _gone_or_moved(node, name, before, after, (probes, exports), gpu_modules, version):
            return text  # a GPU import stays: it may depend on the version the host really has
    lines = split_lines(text)
    literal = '"' + ".".join(map(str, version)) + '"'
    for span in sorted(spans, key=lambda s: (s.lineno, s.col_offset), reverse=True):
        raw = lines[span.lineno - 1].encode("utf-8")
        lines[span.lineno - 1] = (
            raw[: span.col_offset] + literal.encode() + raw[span.end_col_offset or span.col_offset :]
        ).decode("utf-8")
    return "".join(lines)


def _gone_or_moved(node, pinned, before, after, seen, gpu_modules, version) -> bool:
    """Every GPU name ``node`` imports is dead, or is ``pinned`` (read only for its version), or can
    move to a drop-in (judged as inside a ``try``: the strictest case)."""
    module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
    for alias in node.names:
        full = alias.name if isinstance(node, ast.Import) else f"{module}.{alias.name}"
        if not any(full == m or full.startswith(m + ".") for m in gpu_modules):
            continue
        bound = alias.asname or alias.name.split(".")[0]
        if isinstance(node, ast.ImportFrom) and node.level:
            continue
        if bound == pinned or (before[bound] and not after[bound]):
            continue
        probes, exports = seen
        if isinstance(node, ast.ImportFrom) and target(
            module, alias.name, bound, before, after, probes, exports, True, version
        ):
            continue
        return False
    return True
