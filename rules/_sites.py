"""Where a matched node sits: parent lookup and result-usage analysis for the torch catalogue rules.

The engine hands rules the node (for calls: the *updated* node, a fresh object) but not its parents.
The chunk being transformed is the module behind :attr:`RuleContext.code_for_node` (a bound
``Module.code_for_node``); these helpers find the node there -- by identity, or for calls by
structural equality -- and walk up. Everything degrades to "unknown" (callers then refuse or stay
conservative) when the chunk is not available.
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import RuleContext

_CACHE: dict[int, tuple[cst.Module, dict[int, cst.CSTNode], list[cst.CSTNode]]] = {}


def _module(ctx: RuleContext) -> cst.Module | None:
    owner = getattr(ctx.code_for_node, "__self__", None)
    return owner if isinstance(owner, cst.Module) else None


def _index(module: cst.Module) -> tuple[dict[int, cst.CSTNode], list[cst.CSTNode]]:
    """(id(child) -> parent, every node in pre-order) for ``module``; cached for the last chunk."""
    cached = _CACHE.get(id(module))
    if cached is not None and cached[0] is module:
        return cached[1], cached[2]
    parents: dict[int, cst.CSTNode] = {}
    order: list[cst.CSTNode] = []

    def walk(node: cst.CSTNode) -> None:
        order.append(node)
        for child in node.children:
            parents[id(child)] = node
            walk(child)

    walk(module)
    _CACHE.clear()
    _CACHE[id(module)] = (module, parents, order)
    return parents, order


def originals(node: cst.CSTNode, ctx: RuleContext) -> list[cst.CSTNode]:
    """The node(s) of the chunk that ``node`` stands for: itself if present, else deep-equal nodes."""
    module = _module(ctx)
    if module is None:
        return []
    parents, order = _index(module)
    if id(node) in parents:
        return [node]
    return [n for n in order if type(n) is type(node) and n.deep_equals(node)]


def parent(node: cst.CSTNode, ctx: RuleContext) -> cst.CSTNode | None:
    """The parent of a node of the chunk (None when unknown)."""
    module = _module(ctx)
    if module is None:
        return None
    parents, _ = _index(module)
    return parents.get(id(node))


def ancestors(node: cst.CSTNode, ctx: RuleContext):
    """Parents of ``node`` from the nearest up (skipping nothing)."""
    current = parent(node, ctx)
    while current is not None:
        yield current
        current = parent(current, ctx)


def _usage_of(node: cst.CSTNode, ctx: RuleContext) -> str:
    up = parent(node, ctx)
    if isinstance(up, cst.Subscript) and up.value is node:
        return "tuple"
    if isinstance(up, cst.Attribute) and up.value is node:
        return "plain"  # a method/attribute of the result: a tensor (a tuple has no .transpose)
    if isinstance(up, cst.Arg) and up.star == "":
        return "plain" if isinstance(parent(up, ctx), cst.Call) else "unknown"
    if isinstance(up, cst.Assign) and up.value is node:
        targets = [t.target for t in up.targets]
        if any(isinstance(t, (cst.Tuple, cst.List)) for t in targets):
            return "tuple"
        names = [t.value for t in targets if isinstance(t, cst.Name)]
        if len(names) == len(targets) and names:
            return "tuple" if _subscripted_later(up, set(names), ctx) else "plain"
    return "unknown"


def _subscripted_later(assign: cst.Assign, names: set[str], ctx: RuleContext) -> bool:
    """True when one of ``names`` is subscripted (``out[0]``) in the enclosing function/chunk."""
    scope = None
    for up in ancestors(assign, ctx):
        if isinstance(up, (cst.FunctionDef, cst.Module)):
            scope = up
            break
    if scope is None:
        return True  # unknown: assume the worst (tuple use)
    found = []

    class _Finder(cst.CSTVisitor):
        def visit_Subscript(self, sub: cst.Subscript) -> None:
            if isinstance(sub.value, cst.Name) and sub.value.value in names:
                found.append(sub)

    scope.visit(_Finder())
    return bool(found)


_SEEN: dict[str, object] = {"module": None, "counts": {}}


def locate(call: cst.Call, ctx: RuleContext) -> cst.CSTNode | None:
    """The chunk's original node for a call the engine is asking about (None when unknown).

    Identical calls in one chunk are told apart by order: the engine asks about them in source
    order, so the k-th question about a given call text in a chunk is the k-th such call.
    """
    found = originals(call, ctx)
    if len(found) <= 1:
        return found[0] if found else None
    module = _module(ctx)
    if _SEEN["module"] is not module:
        _SEEN["module"], _SEEN["counts"] = module, {}
    key = ctx.code(call)
    index = _SEEN["counts"].get(key, 0)
    _SEEN["counts"][key] = index + 1
    return found[index] if index < len(found) else None


def result_usage(call: cst.Call, ctx: RuleContext) -> str:
    """How the call's result is used: ``"tuple"`` (indexed or unpacked), ``"plain"`` (assigned to
    names that are never subscripted in the enclosing function, or used as a tensor) or ``"unknown"``."""
    found = originals(call, ctx)
    if not found:
        return "unknown"
    kinds = {_usage_of(node, ctx) for node in found}
    if len(kinds) == 1:
        return kinds.pop()
    node = locate(call, ctx)
    return _usage_of(node, ctx) if node is not None else "unknown"


def simple(node: cst.BaseExpression) -> bool:
    """True for expressions that are cheap and side-effect free to evaluate twice (names,
    attributes, subscripts of those with literal/name indices)."""
    if isinstance(node, cst.Name):
        return True
    if isinstance(node, cst.Attribute):
        return simple(node.value)
    if isinstance(node, cst.Subscript):
        return simple(node.value) and all(
            isinstance(e.slice, cst.Index) and isinstance(e.slice.value, (cst.Name, cst.Integer, cst.SimpleString))
            for e in node.slice
        )
    return False
