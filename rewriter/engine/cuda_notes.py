"""CUDA-only code next to a ported site: the lines a TPU host would still fail on.

A ported attention call followed by ``x.cuda()``, ``device="cuda"``, ``torch.device("cuda")``,
``torch.cuda.get_device_capability()`` or ``assert q.device.type == "cuda"`` looks done but fails on
a TPU host. :func:`annotate` adds a note naming each such line (and its code) to the first rewritten
site of the same top-level function or class, so every output format (text, JSON, HTML) lists it.
``torch.cuda.is_available()`` and ``if x.device.type == "cuda":`` are left alone: they answer False
there and the code takes its other branch.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
from collections.abc import Sequence

from flashport.rewriter.engine.results import Site

# torch.cuda functions that need a CUDA device (is_available / device_count answer on any host)
_NEEDS_DEVICE = frozenset(
    (
        "get_device_capability",
        "get_device_properties",
        "get_device_name",
        "current_device",
        "set_device",
        "synchronize",
        "mem_get_info",
        "Stream",
        "Event",
        "current_stream",
    )
)


def _is_cuda_string(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cuda"
    )


def _cuda_only(node: ast.AST) -> bool:
    """Whether ``node`` itself needs a CUDA device (see the module docstring)."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "cuda":
            # x.cuda(), self.weight.cuda(); `torch.cuda` itself is a module, never called
            return not (isinstance(func.value, ast.Name) and func.value.id == "torch")
        if (
            isinstance(func, ast.Attribute)
            and func.attr in _NEEDS_DEVICE
            and isinstance(func.value, ast.Attribute)
            and func.value.attr == "cuda"
        ):
            return True
        if any(k.arg == "device" and _is_cuda_string(k.value) for k in node.keywords):
            return True
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in ("device", "to") and bool(node.args) and _is_cuda_string(node.args[0])
    if isinstance(node, ast.Assert):  # a branch on the device type is fine; an assert fails
        return any(
            isinstance(n, ast.Compare)
            and isinstance(n.left, ast.Attribute)
            and n.left.attr == "type"
            and any(_is_cuda_string(c) for c in n.comparators)
            and any(isinstance(op, (ast.Eq, ast.Is)) for op in n.ops)
            for n in ast.walk(node.test)
        )
    return False


def cuda_only_lines(top: ast.stmt) -> list[int]:
    """The lines inside the top-level statement ``top`` that hold CUDA-only code, in order."""
    return sorted({getattr(n, "lineno", top.lineno) for n in ast.walk(top) if _cuda_only(n)})


def annotate(sites: Sequence[Site], tree: ast.Module, lines: Sequence[str]) -> list[Site]:
    """``sites`` with a note on the first rewritten site of each top-level statement that also holds
    CUDA-only code, naming each such line."""
    out = list(sites)
    firsts = [top.lineno for top in tree.body]
    first_site: dict[int, int] = {}  # top-level statement index -> index in ``out`` of its first port
    for index, site in enumerate(out):
        if site.status != "rewrite" or site.kind not in ("call", "reference"):
            continue
        top = bisect.bisect_right(firsts, site.line) - 1
        if top >= 0 and site.line <= (tree.body[top].end_lineno or firsts[top]):
            first_site.setdefault(top, index)
    # only the statements holding a port are walked: the pass stays linear in the file's size
    for top, index in first_site.items():
        cuda = cuda_only_lines(tree.body[top])
        if not cuda:
            continue
        notes = tuple(
            f"CUDA-only code beside this port, line {n}: `{lines[n - 1].strip()[:80]}` fails on a TPU host"
            for n in cuda
        )
        out[index] = dataclasses.replace(out[index], notes=out[index].notes + notes)
    return out
