"""Whether an SDPA backend selector statically leaves torch SDPA its math kernel (FPA102).

``sdpa_kernel(backends)`` restricts torch SDPA to ``backends`` while it is active; a call no listed
kernel supports raises "No viable backend". The math kernel (``SDPBackend.MATH``) runs every input
on every device, so a selector whose backends include it never leaves an SDPA call without a kernel
on any host, a TPU host's CPU torch included: it only orders or narrows the GPU kernels, and it runs
as is there, wherever it is used (a ``with`` item, returned by a helper, bound to a name).

Read statically, nothing else: ``sdpa_kernel(SDPBackend.MATH)``, ``sdpa_kernel([..., SDPBackend.MATH],
set_priority=True)``, the same list bound once to a module-level constant of the file (also inside a
module-level ``try``/``if``) or to a variable an enclosing function binds once (a local list),
that is only ever passed to ``sdpa_kernel`` (so nothing can change it),
and the deprecated ``torch.backends.cuda.sdp_kernel(...)`` unless ``enable_math`` is passed as
anything but ``True``. ``SDPBackend`` is resolved through the file's imports at module level and in
the selector's function (``from torch.nn.attention import SDPBackend`` inside a helper), never
through a name the file also assigns.
"""

from __future__ import annotations

import ast

import libcst as cst

from flashport.rewriter.source import semantic
from flashport.rules.site import RuleContext

SDPA_KERNEL = "torch.nn.attention.sdpa_kernel"
MATH = frozenset({"torch.nn.attention.SDPBackend.MATH", "torch.backends.cuda.SDPBackend.MATH"})
SDP_KERNEL = ("enable_flash", "enable_math", "enable_mem_efficient", "enable_cudnn")


def includes_math(call: cst.Call, ctx: RuleContext) -> bool:
    """True when the selector ``call`` (``ctx.qualified_name`` says which one) provably keeps
    ``SDPBackend.MATH`` among its backends; False when it does not or that cannot be told."""
    selector = ctx.qualified_name.rsplit(".", 1)[-1]
    if any(arg.star for arg in call.args):
        return False
    if selector == "sdp_kernel":
        flag = _argument(call, SDP_KERNEL.index("enable_math"), "enable_math")
        return flag is None or (isinstance(flag, cst.Name) and flag.value == "True")
    if selector != "sdpa_kernel" or ctx.semantic is None:
        return False
    backends = _argument(call, 0, "backends")
    return backends is not None and _has_math(backends, ctx)


def _argument(call: cst.Call, index: int, name: str) -> cst.BaseExpression | None:
    """The argument bound to parameter ``name`` (position ``index``), or None when not passed."""
    positional = [arg for arg in call.args if arg.keyword is None]
    if index < len(positional):
        return positional[index].value
    return next((arg.value for arg in call.args if arg.keyword and arg.keyword.value == name), None)


def _has_math(node: cst.BaseExpression, ctx: RuleContext) -> bool:
    """``node`` is ``SDPBackend.MATH``, a list/tuple holding it, or a module constant that is one
    (:func:`constant_backends`)."""
    if isinstance(node, (cst.List, cst.Tuple)):
        return any(isinstance(e, cst.Element) and ctx.qualified_names(e.value) & MATH for e in node.elements)
    if ctx.qualified_names(node) & MATH:
        return True
    if isinstance(node, cst.Name):
        value = constant_backends(node.value, ctx)
        if isinstance(value, (ast.List, ast.Tuple)):
            return any(ctx.qualified_names(e) & MATH for e in value.elts)
        return value is not None and bool(ctx.qualified_names(value) & MATH)
    return False


def constant_backends(name: str, ctx: RuleContext) -> ast.expr | None:
    """The value of the module constant ``name`` (:meth:`RuleContext.module_constant`) when the
    file reads it only as the backends argument of ``sdpa_kernel(...)`` calls (nothing can
    mutate it); else None."""
    value = ctx.module_constant(name)
    reads = ctx.loads(name)
    if value is None and ctx.semantic is not None:
        local = ctx.semantic.local_value(name, ctx.line)  # a list a function binds once for its selectors
        if local is not None:
            value, function = local
            span = range(function.lineno, (function.end_lineno or function.lineno) + 1)  # type: ignore[attr-defined]
            reads = [read for read in reads if read.lineno in span]
    if value is None or not all(_selector_argument(read, ctx) for read in reads):
        return None
    return value


def _selector_argument(read: ast.Name, ctx: RuleContext) -> bool:
    """Whether ``read`` is the backends argument (first positional or ``backends=``) of a call that
    resolves to torch's ``sdpa_kernel`` where it stands (aliases included: ``sdpa_kernel as _k``)."""
    model = ctx.semantic
    up = model.parent(read) if model is not None else None
    if isinstance(up, ast.keyword) and up.arg == "backends":
        up = model.parent(up) if model is not None else None
    elif not (isinstance(up, ast.Call) and up.args[:1] == [read]):
        return False
    return (
        model is not None
        and isinstance(up, ast.Call)
        and model.qualified_name_at(semantic.dotted(up.func), up.lineno) == SDPA_KERNEL
    )
