"""Whether an SDPA backend selector statically leaves torch SDPA its math kernel (FPA102).

``sdpa_kernel(backends)`` restricts torch SDPA to ``backends`` while it is active; a call no listed
kernel supports raises "No viable backend". The math kernel (``SDPBackend.MATH``) runs every input
on every device, so a selector whose backends include it never leaves an SDPA call without a kernel
on any host, a TPU host's CPU torch included: it only orders or narrows the GPU kernels, and it runs
as is there, wherever it is used (a ``with`` item, returned by a helper, bound to a name).

Read statically, nothing else: ``sdpa_kernel(SDPBackend.MATH)``, ``sdpa_kernel([..., SDPBackend.MATH],
set_priority=True)``, the same list bound once to a module-level constant of the file (also inside a
module-level ``try``/``if``) that is only ever passed to ``sdpa_kernel`` (so nothing can change it),
and the deprecated ``torch.backends.cuda.sdp_kernel(...)`` unless ``enable_math`` is passed as
anything but ``True``. ``SDPBackend`` is resolved through the file's imports at module level and in
the selector's function (``from torch.nn.attention import SDPBackend`` inside a helper), never
through a name the file also assigns.
"""

from __future__ import annotations

import ast

import libcst as cst

from flashport.rules.torch.selector_body import import_bindings, qualified

SDPA_KERNEL = "torch.nn.attention.sdpa_kernel"
MATH = frozenset({"torch.nn.attention.SDPBackend.MATH", "torch.backends.cuda.SDPBackend.MATH"})
SDP_KERNEL = ("enable_flash", "enable_math", "enable_mem_efficient", "enable_cudnn")


def includes_math(call: cst.Call, ctx) -> bool:
    """True when the selector ``call`` (``ctx.qualified_name`` says which one) provably keeps
    ``SDPBackend.MATH`` among its backends; False when it does not or that cannot be told."""
    selector = ctx.qualified_name.rsplit(".", 1)[-1]
    if any(arg.star for arg in call.args):
        return False
    if selector == "sdp_kernel":
        flag = _argument(call, SDP_KERNEL.index("enable_math"), "enable_math")
        return flag is None or (isinstance(flag, cst.Name) and flag.value == "True")
    if selector != "sdpa_kernel" or ctx.module is None:
        return False
    backends = _argument(call, 0, "backends")
    bindings = _bindings(ctx.tree, ctx.line) if ctx.tree is not None else import_bindings(ctx.module)
    return backends is not None and _has_math(backends, bindings, ctx.tree)


def _module_scope(tree: ast.Module):
    """The statements that run in the module's own scope: top level and inside module-level
    ``if``/``try``/``with`` blocks (not in functions or classes)."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        statement = pending.pop(0)
        yield statement
        if isinstance(statement, (ast.If, ast.With)):
            pending.extend(statement.body)
            pending.extend(getattr(statement, "orelse", []))
        elif isinstance(statement, ast.Try):
            pending.extend(statement.body + statement.orelse + statement.finalbody)
            for handler in statement.handlers:
                pending.extend(handler.body)


def _bindings(tree: ast.Module, line: int) -> dict[str, str]:
    """Import bindings (local name -> qualified name) at module scope and in the innermost function
    around ``line``; a name imported as two different things, or also assigned anywhere, is left out."""
    imports = [s for s in _module_scope(tree) if isinstance(s, (ast.Import, ast.ImportFrom))]
    functions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.lineno <= line <= (node.end_lineno or node.lineno)
    ]
    if functions:
        inner = max(functions, key=lambda f: f.lineno)
        imports += [n for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found: dict[str, set[str]] = {}
    last_star = max(_star_import_lines(tree), default=0)
    for statement in imports:
        if isinstance(statement, ast.ImportFrom) and (statement.level or not statement.module):
            continue
        if statement.lineno < last_star:
            continue  # a later `from m import *` may rebind the name
        for alias in statement.names:
            if isinstance(statement, ast.ImportFrom):
                local, target = alias.asname or alias.name, f"{statement.module}.{alias.name}"
            else:
                local = alias.asname or alias.name.split(".")[0]
                target = alias.name if alias.asname else local
            found.setdefault(local, set()).add(target)
    assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    return {name: next(iter(t)) for name, t in found.items() if len(t) == 1 and name not in assigned}


def _argument(call: cst.Call, index: int, name: str) -> cst.BaseExpression | None:
    """The argument bound to parameter ``name`` (position ``index``), or None when not passed."""
    positional = [arg for arg in call.args if arg.keyword is None]
    if index < len(positional):
        return positional[index].value
    return next((arg.value for arg in call.args if arg.keyword and arg.keyword.value == name), None)


def _has_math(node: cst.BaseExpression, bindings: dict[str, str], tree: ast.Module | None) -> bool:
    """``node`` is ``SDPBackend.MATH``, a list/tuple holding it, or a module constant that is one."""
    if isinstance(node, (cst.List, cst.Tuple)):
        return any(isinstance(e, cst.Element) and qualified(e.value, bindings) in MATH for e in node.elements)
    if qualified(node, bindings) in MATH:
        return True
    if isinstance(node, cst.Name) and tree is not None:
        value = module_constant(tree, node.value)
        if isinstance(value, (ast.List, ast.Tuple)):
            return any(_dotted_in(e, bindings) in MATH for e in value.elts)
        return value is not None and _dotted_in(value, bindings) in MATH
    return False


def _dotted_in(node: ast.expr, bindings: dict[str, str]) -> str:
    """The qualified name of an ``ast`` Name/Attribute chain through ``bindings``; "" otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bindings:
        return ""
    return ".".join([bindings[node.id], *reversed(parts)])


def module_constant(tree: ast.Module, name: str) -> ast.expr | None:
    """The value of ``name`` when the file binds it exactly once, by ``name = value`` at module scope
    (:func:`_module_scope`), and reads it only as the backends argument of ``sdpa_kernel(...)``
    calls (nothing can rebind or mutate it); else None. A star import after that statement may
    rebind any name, so it makes the value unknown (one before it is overridden by it)."""
    binding: ast.Assign | None = None
    for statement in _module_scope(tree):
        if (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
            and statement.targets[0].id == name
        ):
            binding = statement
    if binding is None or max(_star_import_lines(tree), default=0) > binding.lineno:
        return None
    allowed = _selector_arguments(tree, name)
    stores = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name:
            if not isinstance(node.ctx, ast.Load):
                stores += 1
            elif id(node) not in allowed:
                return None
        elif _binds(node, name):
            return None
    return binding.value if stores == 1 else None


def _star_import_lines(tree: ast.Module) -> list[int]:
    """Lines of the file's ``from m import *`` statements (module scope: the only place Python allows them)."""
    return [
        s.lineno
        for s in _module_scope(tree)
        if isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names)
    ]


def _selector_arguments(tree: ast.Module, name: str) -> set[int]:
    """ids of the ``name`` Loads passed as the backends of a call that resolves to torch's
    ``sdpa_kernel`` (through the imports, aliases included: ``sdpa_kernel as _sdpa_kernel``)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not any(
            isinstance(a, ast.Name) and a.id == name
            for a in [*node.args[:1], *(k.value for k in node.keywords)]
        ):
            continue
        if _dotted_in(node.func, _bindings(tree, node.lineno)) != SDPA_KERNEL:
            continue
        values = node.args[:1] + [k.value for k in node.keywords if k.arg == "backends"]
        found.update(id(v) for v in values if isinstance(v, ast.Name) and v.id == name)
    return found


def _binds(node: ast.AST, name: str) -> bool:
    """Whether ``node`` binds ``name`` other than as an ``ast.Name`` target (counted apart; star
    imports: :func:`_star_import_lines`)."""
    if isinstance(node, ast.arg):
        return node.arg == name
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.alias):
        return (node.asname or node.name.split(".")[0]) == name
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return name in node.names
    if isinstance(node, ast.ExceptHandler):
        return node.name == name
    if isinstance(node, (ast.MatchAs, ast.MatchStar)):
        return node.name == name
    if isinstance(node, ast.MatchMapping):
        return node.rest == name
    return False
