"""When an SDPA backend selector (``with sdpa_kernel(...):``) may be made neutral (FPA102).

A selector only picks CUDA kernels for the SDPA calls that run inside it. It may be replaced by
``contextlib.nullcontext()`` only when every call in its body is either a direct
``torch.nn.functional.scaled_dot_product_attention`` call that FPA101 rewrites (resolved through
the file's top-level imports) or a tensor method from a short list (``.transpose``, ``.view``, ...):
any other call (``self.proj(x)``, ``model(x)``) may reach SDPA indirectly, so the selector stays.
"""

from __future__ import annotations

import libcst as cst

from flashport.rules import _sites
from flashport.rules.base import Refuse, Rewrite

SDPA = "torch.nn.functional.scaled_dot_product_attention"
TENSOR_METHODS = frozenset(
    {
        "transpose",
        "permute",
        "contiguous",
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "unsqueeze",
        "squeeze",
        "expand",
        "to",
        "float",
        "half",
        "bfloat16",
        "type_as",
        "chunk",
        "split",
        "unbind",
        "size",
        "dim",
    }
)


def _bindings(module: cst.Module) -> dict[str, str]:
    """Top-level import bindings: local name -> qualified module or object name."""
    out: dict[str, str] = {}
    for statement in module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    name = _dotted_text(alias.name)
                    if alias.asname is not None:
                        out[_dotted_text(alias.asname.name)] = name
                    else:
                        out[name.split(".")[0]] = name.split(".")[0]
            elif isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative:
                if isinstance(small.names, cst.ImportStar):
                    continue
                base = _dotted_text(small.module)
                for alias in small.names:
                    local = _dotted_text(alias.asname.name if alias.asname is not None else alias.name)
                    out[local] = f"{base}.{_dotted_text(alias.name)}"
    return out


def _dotted_text(node: cst.BaseExpression) -> str:
    """``a.b.c`` for a Name/Attribute chain; "" for anything else."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted_text(node.value)}.{node.attr.value}"
    return ""


def _qualified(func, bindings) -> str:
    text = _dotted_text(func)
    if not text:
        return ""
    head, _, rest = text.partition(".")
    if head not in bindings:
        return ""
    return bindings[head] + ("." + rest if rest else "")


def neutral_selector(call: cst.Call, ctx, sdpa_rule) -> Rewrite | str:
    """``contextlib.nullcontext()`` when the selector's body is provably all rewritten SDPA, else why not."""
    node = _sites.locate(call, ctx)
    item = _sites.parent(node, ctx) if node is not None else None
    if not isinstance(item, cst.WithItem):
        return "not used as a `with` item"
    with_node = _sites.parent(item, ctx)
    module = ctx.module
    if not isinstance(with_node, cst.With) or module is None:
        return "its `with` statement could not be located"
    bindings = _bindings(module)
    calls: list[cst.Call] = []

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
    sdpa_calls = 0
    for inner in calls:
        if not isinstance(inner, cst.Call):
            return "its body defines a function or lambda"
        if _qualified(inner.func, bindings) == SDPA:
            try:
                outcome = sdpa_rule.check_call(inner, ctx)
            except Refuse as refusal:
                return f"an SDPA call in its body is not rewritten ({refusal.reason})"
            if not isinstance(outcome, Rewrite):
                return "an SDPA call in its body is not rewritten"
            sdpa_calls += 1
        elif not (isinstance(inner.func, cst.Attribute) and inner.func.attr.value in TENSOR_METHODS):
            return f"its body calls {ctx.code(inner.func)}(...), which may run SDPA under this selector"
    if not sdpa_calls:
        return "its body has no SDPA call"
    return Rewrite(
        cst.parse_expression("contextlib.nullcontext()"),
        imports=("contextlib",),
        notes=("every SDPA call in the body is rewritten: selector made neutral (contextlib.nullcontext())",),
    )
