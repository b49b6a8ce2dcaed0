"""When an SDPA backend selector (``with sdpa_kernel(...):``) may be made neutral (FPA102).

A selector only picks CUDA kernels for the SDPA calls that run inside it. It may be replaced by
``contextlib.nullcontext()`` only when every call in its body is either a direct
``torch.nn.functional.scaled_dot_product_attention`` call (resolved through the file's imports:
:meth:`~flashport.rules.site.RuleContext.qualified_names`) or a tensor method from a short list (``.transpose``, ``.view``, ...): any other call
(``self.proj(x)``, ``model(x)``) may reach SDPA indirectly, so the selector stays. Whether those SDPA
calls end rewritten is not asked here (no rule asks another): the rewrite names them
(``Rewrite.requires``) and the engine's per-file phase refuses it when one of them stays torch SDPA
(refused, suppressed, ``--ignore``d or declined in ``--interactive`` review).
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Rewrite
from flashport.rules.common import node_context
from flashport.rules.common.calls import callee_name

SDPA = "torch.nn.functional.scaled_dot_product_attention"
TENSOR_METHODS = node_context.TENSOR_METHODS


def _bound_with(node: cst.CSTNode, ctx) -> cst.With | str:
    """The ``with`` statement that uses a selector bound to a local name first:
    ``context = sdpa_kernel(...) [if c else nullcontext()]`` then ``with context:``. The name must be
    assigned once in the enclosing function and read once, as that ``with``'s only item (a nested
    ``def`` with its own variable of that name does not count: :func:`_binds_locally`); else why not."""
    up = node_context.parent(node, ctx)
    if isinstance(up, cst.IfExp) and node is not up.test:
        node, up = up, node_context.parent(up, ctx)
    if isinstance(up, cst.Return):
        return (
            "returned by its function, not used as a `with` item here: the `with` statements of its "
            "callers (other functions or modules) and what runs under them are out of sight"
        )
    if not (
        isinstance(up, cst.Assign)
        and up.value is node
        and len(up.targets) == 1
        and isinstance(up.targets[0].target, cst.Name)
    ):
        return "not used as a `with` item"
    name = up.targets[0].target.value
    function = next((a for a in node_context.ancestors(up, ctx) if isinstance(a, cst.FunctionDef)), None)
    if function is None:
        return f"bound to {name} outside a function: its uses are out of sight"
    names: list[cst.Name] = []
    withs: list[cst.With] = []

    class _Uses(cst.CSTVisitor):
        def visit_Name(self, inner: cst.Name) -> None:
            if inner.value == name:
                names.append(inner)

        def visit_FunctionDef(self, inner: cst.FunctionDef) -> bool:
            return not _binds_locally(inner, name)  # its own variable of that name is another one

        def visit_With(self, inner: cst.With) -> None:
            if len(inner.items) == 1 and isinstance(inner.items[0].item, cst.Name):
                if inner.items[0].item.value == name and inner.items[0].asname is None:
                    withs.append(inner)

    function.body.visit(_Uses())
    if len(names) != 2 or len(withs) != 1:
        return f"bound to {name}, which is not used exactly once as a `with` item in this function"
    return withs[0]


def _binds_locally(function: cst.FunctionDef, name: str) -> bool:
    """True when a nested ``def`` has its own local ``name``: a parameter of that name, or a plain
    assignment ``name = ...`` in its own body (not in a deeper ``def``/``lambda``/``class``), and no
    ``nonlocal name`` / ``global name`` in it. Its reads of ``name`` are then not the enclosing
    function's variable. Any other binding form counts as not local (the caller then stays
    conservative and counts the nested reads)."""
    params = function.params
    every = [
        *params.posonly_params,
        *params.params,
        *params.kwonly_params,
        params.star_arg,
        params.star_kwarg,
    ]
    found = {"param": any(isinstance(p, cst.Param) and p.name.value == name for p in every)}

    class _Own(cst.CSTVisitor):
        def visit_FunctionDef(self, inner: cst.FunctionDef) -> bool:
            return False

        def visit_Lambda(self, inner: cst.Lambda) -> bool:
            return False

        def visit_ClassDef(self, inner: cst.ClassDef) -> bool:
            return False

        def visit_Assign(self, inner: cst.Assign) -> None:
            if any(isinstance(t.target, cst.Name) and t.target.value == name for t in inner.targets):
                found["assign"] = True

        def visit_Nonlocal(self, inner: cst.Nonlocal) -> None:
            if any(n.name.value == name for n in inner.names):
                found["shared"] = True

        def visit_Global(self, inner: cst.Global) -> None:
            if any(n.name.value == name for n in inner.names):
                found["shared"] = True

    function.body.visit(_Own())
    return (found["param"] or found.get("assign", False)) and not found.get("shared", False)


def neutral_selector(call: cst.Call, ctx, otherwise: str) -> Rewrite | str:
    """``contextlib.nullcontext()`` requiring the SDPA calls of the selector's body when that body
    is only SDPA calls and tensor methods, else why not. The selector is a ``with`` item, or bound
    to a local name that one ``with`` uses (:func:`_bound_with`). ``otherwise``: the reason when one
    of those SDPA calls does not end rewritten (``Rewrite.otherwise``)."""
    node = node_context.locate(call, ctx)
    item = node_context.parent(node, ctx) if node is not None else None
    if node is None:
        return "its `with` statement could not be located"
    with_node: cst.CSTNode | None
    if isinstance(item, cst.IfExp) and node is not item.test:
        choice = node_context.parent(item, ctx)  # `with (sdpa_kernel(...) if c else nullcontext()):`
        item = choice if isinstance(choice, cst.WithItem) else item
    if isinstance(item, cst.WithItem):
        with_node = node_context.parent(item, ctx)
    else:
        bound = _bound_with(node, ctx)
        if isinstance(bound, str):
            return bound
        with_node = bound
    if not isinstance(with_node, cst.With) or ctx.semantic is None:
        return "its `with` statement could not be located"
    return _neutral_body(with_node, ctx, otherwise)


def _neutral_body(with_node: cst.With, ctx, otherwise: str) -> Rewrite | str:
    """The nullcontext rewrite, requiring every SDPA call of the ``with`` body, when every call in
    it is an SDPA call or a tensor method, else why not."""
    calls: list[cst.CSTNode] = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, inner: cst.Call) -> None:
            calls.append(inner)

        def visit_FunctionDef(self, inner) -> bool:
            calls.append(inner)  # a nested def: not analysed
            return False

        def visit_Lambda(self, inner) -> bool:
            calls.append(inner)
            return False

    with_node.body.visit(_Calls())
    if _yields(with_node.body):
        return "its body yields: what runs under it is its callers' code, out of sight"
    sdpa_calls: list[cst.Call] = []
    for inner in calls:
        if not isinstance(inner, cst.Call):
            return "its body defines a function or lambda"
        if SDPA in ctx.qualified_names(inner.func):
            sdpa_calls.append(inner)
        elif not (isinstance(inner.func, cst.Attribute) and inner.func.attr.value in TENSOR_METHODS):
            return f"its body calls {ctx.code(inner.func)}(...), which may run SDPA under this selector"
    if not sdpa_calls:
        return "its body has no SDPA call"
    return Rewrite(
        cst.parse_expression("contextlib.nullcontext()"),
        imports=("contextlib",),
        notes=("every SDPA call in the body is rewritten: selector made neutral (contextlib.nullcontext())",),
        requires=tuple(sdpa_calls),
        otherwise=otherwise,
    )


def _yields(body: cst.BaseSuite) -> bool:
    """True when ``body`` holds a ``yield`` outside nested functions (a context manager's body)."""
    found: list[cst.CSTNode] = []

    class _Yields(cst.CSTVisitor):
        def visit_Yield(self, inner: cst.Yield) -> None:
            found.append(inner)

        def visit_FunctionDef(self, inner) -> bool:
            return False

        def visit_Lambda(self, inner) -> bool:
            return False

    body.visit(_Yields())
    return bool(found)


PROBE_METHODS = TENSOR_METHODS | {"sum", "mean", "all", "item", "backward"}


def probe_only(call: cst.Call, ctx) -> bool:
    """True when ``call`` is the ``with`` item of a selector whose body only runs SDPA on tensors its
    function makes itself (:func:`node_context.synthetic_query`) and tensor methods (a kernel probe)."""
    node = node_context.locate(call, ctx)
    item = node_context.parent(node, ctx) if node is not None else None
    with_node = node_context.parent(item, ctx) if isinstance(item, cst.WithItem) else None
    if not isinstance(with_node, cst.With):
        return False
    function = node_context.enclosing_function(with_node, ctx)
    calls: list[cst.CSTNode] = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, inner: cst.Call) -> None:
            calls.append(inner)

        def visit_FunctionDef(self, inner) -> bool:
            calls.append(inner)
            return False

    with_node.body.visit(_Calls())
    sdpa = 0
    for inner in calls:
        if not isinstance(inner, cst.Call):
            return False
        if callee_name(inner).endswith("scaled_dot_product_attention"):
            if not node_context.synthetic_query(inner, function):
                return False
            sdpa += 1
        elif not (isinstance(inner.func, cst.Attribute) and inner.func.attr.value in PROBE_METHODS):
            return False
    return sdpa > 0
