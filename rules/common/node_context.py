"""Where a matched node sits: parent lookup and result-usage analysis for the torch catalogue rules.

The engine hands every rule the original node it asks about (``ctx.node``) and that node's
original parents (``ctx.ancestors``, nearest first), so these helpers never search the chunk for
the node: identical calls are different nodes. Everything degrades to "unknown" (callers then
refuse or stay conservative) outside the engine, where the context carries no node.
"""

from __future__ import annotations

import ast
import itertools
import re

import libcst as cst

from flashport.rules.common.calls import callee_name
from flashport.rules.common.literals import literal_string
from flashport.rules.site import RuleContext

# tensor methods that only reshape, view or cast: they run no attention and reduce nothing
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


def _path(ctx: RuleContext) -> list[cst.CSTNode]:
    return [ctx.node, *ctx.ancestors] if ctx.node is not None else []


def locate(call: cst.Call, ctx: RuleContext) -> cst.CSTNode | None:
    """The chunk's original node for the site the engine is asking about (None when unknown)."""
    return ctx.node


def parent(node: cst.CSTNode | None, ctx: RuleContext) -> cst.CSTNode | None:
    """The parent of the site's node or of one of its ancestors (None when unknown)."""
    return ctx.parent(node) if node is not None else None  # type: ignore[return-value]


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


def result_usage(call: cst.Call, ctx: RuleContext) -> str:
    """How the call's result is used: ``"tuple"`` (indexed or unpacked), ``"plain"`` (assigned to
    names that are never subscripted in the enclosing function, or used as a tensor) or ``"unknown"``."""
    node = locate(call, ctx)
    return _usage_of(node, ctx) if node is not None else "unknown"


def _tuple_test(test: cst.BaseExpression, name: str) -> bool:
    """True for ``isinstance(<name>, tuple)``."""
    return (
        isinstance(test, cst.Call)
        and isinstance(test.func, cst.Name)
        and test.func.value == "isinstance"
        and len(test.args) == 2
        and not any(a.star or a.keyword for a in test.args)
        and isinstance(test.args[0].value, cst.Name)
        and test.args[0].value.value == name
        and isinstance(test.args[1].value, cst.Name)
        and test.args[1].value.value == "tuple"
    )


def _reads(node: cst.CSTNode, name: str) -> int:
    """How many times ``name`` occurs in ``node`` (any context)."""
    found: list[cst.Name] = []

    class _Names(cst.CSTVisitor):
        def visit_Name(self, inner: cst.Name) -> None:
            if inner.value == name:
                found.append(inner)

    node.visit(_Names())
    return len(found)


def _normalizes(guard: cst.BaseStatement, name: str) -> bool:
    """True when ``guard`` (the statement right after ``name = <call>``) turns a tuple in ``name``
    into its first item and leaves a non-tuple alone, so the code after it never sees a tuple:
    ``return name[0] if isinstance(name, tuple) else name``, or ``if isinstance(name, tuple):``
    (no ``else``) whose body ends in ``return name[0]`` or ``name = name[0]``."""
    if isinstance(guard, cst.SimpleStatementLine) and len(guard.body) == 1:
        ret = guard.body[0]
        value = ret.value if isinstance(ret, cst.Return) else None
        return (
            isinstance(value, cst.IfExp)
            and _tuple_test(value.test, name)
            and isinstance(value.orelse, cst.Name)
            and value.orelse.value == name
            and _item_of(value.body, name)
        )
    if not (isinstance(guard, cst.If) and guard.orelse is None and _tuple_test(guard.test, name)):
        return False
    body = guard.body.body
    last = body[-1] if body else None
    if not (isinstance(last, cst.SimpleStatementLine) and len(last.body) == 1):
        return False
    small = last.body[0]
    if isinstance(small, cst.Return):
        return small.value is not None and _item_of(small.value, name)
    return (
        isinstance(small, cst.Assign)
        and len(small.targets) == 1
        and isinstance(small.targets[0].target, cst.Name)
        and small.targets[0].target.value == name
        and _item_of(small.value, name)
    )


def _item_of(node: cst.BaseExpression | None, name: str) -> bool:
    """True for ``name[0]`` (the attention output of an ``(out, lse, ...)`` tuple)."""
    return (
        isinstance(node, cst.Subscript)
        and isinstance(node.value, cst.Name)
        and node.value.value == name
        and len(node.slice) == 1
        and isinstance(node.slice[0].slice, cst.Index)
        and isinstance(node.slice[0].slice.value, cst.Integer)
        and node.slice[0].slice.value.value == "0"
    )


def tuple_normalized(call: cst.Call, ctx: RuleContext) -> bool:
    """True when the call's result works the same whether the call returns a tensor or a tuple:
    it is assigned to a plain name (``out = f(...)``) whose next statement keeps only the first item
    of a tuple (:func:`_normalizes`, e.g. ``if isinstance(out, tuple): return out[0]``). Code written
    for both of an API's return conventions (FA3 before and after 2025-07-11) does this."""
    node = locate(call, ctx)
    assign = parent(node, ctx) if node is not None else None
    if not (
        isinstance(assign, cst.Assign)
        and assign.value is node
        and len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
    ):
        return False
    name = assign.targets[0].target.value
    line = parent(assign, ctx)
    block = parent(line, ctx)
    if not (isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1):
        return False
    if not isinstance(block, (cst.IndentedBlock, cst.Module)):
        return False
    statements = list(block.body)
    index = next((i for i, s in enumerate(statements) if s is line), None)
    if index is None or index + 1 >= len(statements) or _reads(assign.value, name):
        return False
    return _normalizes(statements[index + 1], name)


def simple(node: cst.BaseExpression) -> bool:
    """True for expressions that are cheap and side-effect free to evaluate twice (names,
    attributes, subscripts of those with literal/name indices)."""
    if isinstance(node, cst.Name):
        return True
    if isinstance(node, cst.Attribute):
        return simple(node.value)
    if isinstance(node, cst.Subscript):
        return simple(node.value) and all(
            isinstance(e.slice, cst.Index)
            and isinstance(e.slice.value, (cst.Name, cst.Integer, cst.SimpleString))
            for e in node.slice
        )
    return False


SELECTORS = ("sdpa_kernel", "sdp_kernel")


def _selector(item: cst.WithItem) -> cst.Call | None:
    """The item's SDPA backend selector call (``sdpa_kernel(...)``/``sdp_kernel(...)``, by name), if any."""
    call = item.item
    if not isinstance(call, cst.Call):
        return None
    return call if callee_name(call).lstrip("_") in SELECTORS else None


def _constant_backends(call: cst.Call) -> bool:
    """False when the selector takes its backends from a local variable or parameter (a lower-case
    bare name: ``sdpa_kernel([backend])``, ``sdpa_kernel(kernel)``), as a probe over candidates does;
    True for literal backends (``SDPBackend.FLASH_ATTENTION``), UPPER_CASE constants, configured
    attributes (``self.sdpa_backends``) and ``enable_*=`` flags."""

    def constant(node: cst.BaseExpression) -> bool:
        if isinstance(node, (cst.List, cst.Tuple)):
            return all(constant(e.value) for e in node.elements)
        if isinstance(node, cst.Name):
            return node.value in ("True", "False", "None") or node.value.isupper()
        return True

    return all(
        constant(arg.value) for arg in call.args if arg.keyword is None or arg.keyword.value != "set_priority"
    )


def backend_probe(ctx: RuleContext) -> str | None:
    """Why the site looks like an SDPA backend probe -- it runs under a ``with sdpa_kernel(...)``
    selector that sits in a ``try`` body or picks its backends from a variable (``with
    sdpa_kernel([backend]): F.scaled_dot_product_attention(q, q, q)`` asks whether that kernel runs
    here) -- else None. Only the enclosing function is searched. A site whose value is what its
    function computes (:func:`selected_output`) is no probe."""
    path = _path(ctx)
    for index, up in enumerate(path):
        if isinstance(up, (cst.FunctionDef, cst.Lambda, cst.Module)):
            return None
        if not isinstance(up, cst.With):
            continue
        selector = next((s for s in map(_selector, up.items) if s is not None), None)
        if selector is None:
            continue
        guard = next(
            (
                outer
                for outer in path[index + 1 :]
                if (isinstance(outer, cst.Try) and outer.handlers)
                or isinstance(outer, (cst.FunctionDef, cst.Lambda))
            ),
            None,
        )
        guard = guard if isinstance(guard, cst.Try) else None
        # the site in the body, on model data: its value may be what the function computes
        computes = (
            index > 0
            and not isinstance(path[index - 1], cst.WithItem)
            and isinstance(path[0], cst.Call)
            and not synthetic_query(path[0], enclosing_function(path[0], ctx))
        )
        if guard is not None:
            if computes and _fallback_try(guard, up, path[:index]):
                continue  # the try returns the attention or falls back: nothing asks whether it ran
            return "it runs under an SDPA backend selector inside a try block"
        if not _constant_backends(selector) and not (computes and _value_used(path, index, ctx)):
            return "it runs under an SDPA backend selector whose backends are a variable"
    return None


def selected_output(ctx: RuleContext) -> str | None:
    """Why the site, under an SDPA backend selector that could make it a probe (a ``try`` around it,
    backends from a variable), computes what its function goes on with instead (a note for the
    rewrite); None when no such selector is around it."""
    path = _path(ctx)
    for index, up in enumerate(path):
        if isinstance(up, (cst.FunctionDef, cst.Lambda, cst.Module)):
            return None
        selector = (
            next((s for s in map(_selector, up.items) if s is not None), None)
            if isinstance(up, cst.With)
            else None
        )
        if selector is None:
            continue
        for outer in path[index + 1 :]:
            if isinstance(outer, (cst.FunctionDef, cst.Lambda)):
                break
            if isinstance(outer, cst.Try) and outer.handlers:
                return (
                    "under an SDPA backend selector in a try that only returns this attention (its "
                    "handler falls back when that kernel fails): flashport computes it on every host, "
                    "so the fallback no longer runs"
                )
        if not _constant_backends(selector):
            return (
                "under an SDPA backend selector of a chosen kernel, on data its function goes on "
                "with (not a probe): flashport computes the same attention whatever kernel is chosen"
            )
    return None


def _fallback_try(guard: cst.Try, with_node: cst.With, below: list[cst.CSTNode]) -> bool:
    """True when ``guard``'s body is only ``with_node`` and that ``with`` only returns an expression
    holding the site (``below``: the site and its parents up to the ``with``), so success is seen
    only as the attention returned: ``try: with sdpa_kernel(CUDNN): return sdpa(q, k, v) except
    RuntimeError: <fallback>``. A ``try`` that also sets a flag or reads the result is a probe."""
    if len(guard.body.body) != 1 or guard.body.body[0] is not with_node:
        return False
    body = with_node.body.body
    if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) or len(body[0].body) != 1:
        return False
    statement = body[0].body[0]
    return (
        isinstance(statement, cst.Return)
        and statement.value is not None
        and any(node is statement for node in below)
    )


def _flows_on(name: str, ctx: RuleContext) -> bool:
    """True when the site's function reads ``name`` (the site's value) again, and only to return it
    or to reshape it (:data:`TENSOR_METHODS`: ``out.permute(...)``): it goes on as the attention.
    A read that inspects it (``out.isnan().any()``, ``torch.allclose(out, ref)``) or passes it on
    may judge the kernel instead."""
    model = ctx.semantic
    function = model.function_at(ctx.line) if model is not None else None
    if model is None or function is None:
        return False
    span = range(function.lineno, (function.end_lineno or function.lineno) + 1)  # type: ignore[attr-defined]
    reads = [read for read in model.loads(name) if read.lineno in span]
    for read in reads:
        up = model.parent(read)
        if isinstance(up, ast.Return):
            continue
        if not (isinstance(up, ast.Attribute) and up.attr in TENSOR_METHODS):
            return False
        if not (isinstance(model.parent(up), ast.Call) and model.parent(up).func is up):  # type: ignore[union-attr]
            return False
    return bool(reads)


def _value_used(path: list[cst.CSTNode], index: int, ctx: RuleContext) -> bool:
    """True when the site's value (``path[0]``) flows on in its function: returned, part of a larger
    expression or statement, or assigned to names the function goes on with (:func:`_flows_on`);
    False when it is discarded (an expression statement) or only inspected. ``path[index]``: the
    selector's ``with``."""
    node = path[0]
    for up in path[1:index]:
        if isinstance(up, cst.Expr):
            return False
        if isinstance(up, cst.Return):
            return True
        if isinstance(up, cst.Assign):
            names = [t.target.value for t in up.targets if isinstance(t.target, cst.Name)]
            if len(names) != len(up.targets) or up.value is not node:
                return True  # stored into an attribute, an item or a tuple: kept
            return all(_flows_on(name, ctx) for name in names)
        if isinstance(up, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            return True
        node = up
    return True


CUDA_ONLY = "torch.cuda.is_available"


def cuda_only_guard(ctx: RuleContext) -> str | None:
    """The test that lets the site run only on a CUDA device, as source text -- the site sits in the
    body of an ``if`` (or the value branch of ``x if test else y``) whose test, or one operand of
    its ``and``, is ``<tensor>.device.type == "cuda"``, ``<tensor>.is_cuda`` or
    ``torch.cuda.is_available()`` -- else None. A TPU host has no CUDA device, so the site never
    runs there. Only the enclosing function is searched."""
    path = _path(ctx)
    for below, up in itertools.pairwise(path):
        if isinstance(up, (cst.FunctionDef, cst.Lambda, cst.Module)):
            return None
        test = None
        if isinstance(up, cst.IfExp) and below is up.body:
            test = up.test
        elif isinstance(up, cst.If) and below is up.body:
            test = up.test
        found = next((t for t in _conjuncts(test) if _cuda_test(t, ctx)), None) if test is not None else None
        if found is not None:
            return cst.Module([]).code_for_node(found)
    return None


def _conjuncts(test: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The operands of a chain of ``and`` (the test itself when it is none)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _conjuncts(test.left) + _conjuncts(test.right)
    return [test]


def _cuda_test(test: cst.BaseExpression, ctx: RuleContext) -> bool:
    """``x.device.type == "cuda"`` (either side), ``x.is_cuda`` or ``torch.cuda.is_available()``."""
    if isinstance(test, cst.Attribute):  # a tensor's flag, not a setting of the object (`self.is_cuda`)
        return test.attr.value == "is_cuda" and not (
            isinstance(test.value, cst.Name) and test.value.value in ("self", "cls")
        )
    if isinstance(test, cst.Call):
        return not test.args and CUDA_ONLY in ctx.qualified_names(test.func)
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return False
    if not isinstance(test.comparisons[0].operator, cst.Equal):
        return False
    sides = (test.left, test.comparisons[0].comparator)
    return any(
        isinstance(a, cst.Attribute)
        and a.attr.value == "type"
        and isinstance(a.value, cst.Attribute)
        and a.value.attr.value == "device"
        and isinstance(b, cst.SimpleString)
        and b.evaluated_value == "cuda"
        for a, b in (sides, sides[::-1])
    )


_SYNTHETIC = re.compile(r"\btorch\.(randn|rand|zeros|ones|empty|full)\(")


def enclosing_function(node: cst.CSTNode, ctx: RuleContext) -> cst.FunctionDef | None:
    """The innermost ``def`` around ``node`` (None at module level or when unknown)."""
    return ctx.enclosing(node, cst.FunctionDef)  # type: ignore[return-value]


def synthetic_query(call: cst.Call, function: cst.FunctionDef | None) -> bool:
    """True when the call's query (first positional or ``query=``) is a local name of ``function``
    (not a parameter) that every assignment in it binds to ``torch.randn/rand/zeros/ones/empty/full(...)``:
    the call runs on tensors made up for the occasion (a kernel probe), not on model data."""
    query = next((a.value for a in call.args if a.keyword is None and not a.star), None)
    query = next((a.value for a in call.args if a.keyword and a.keyword.value == "query"), query)
    if function is None or not isinstance(query, cst.Name):
        return False
    name = query.value
    params = function.params
    every = [
        *params.posonly_params,
        *params.params,
        *params.kwonly_params,
        params.star_arg,
        params.star_kwarg,
    ]
    if any(isinstance(p, cst.Param) and p.name.value == name for p in every):
        return False
    values: list[bool] = []

    class _Assigns(cst.CSTVisitor):
        def visit_Assign(self, assign: cst.Assign) -> None:
            bound = set().union(*(_target_names(t.target) for t in assign.targets))
            if name in bound:
                values.append(bool(_SYNTHETIC.search(cst.Module([]).code_for_node(assign.value))))

        def visit_AugAssign(self, assign: cst.AugAssign) -> None:
            if name in _target_names(assign.target):
                values.append(False)

    function.body.visit(_Assigns())
    return bool(values) and all(values)


def _target_names(target: cst.BaseExpression) -> set[str]:
    """Names an assignment target binds (``q`` or ``q, k, v``)."""
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(set(), *(_target_names(e.value) for e in target.elements))
    return set()


def splat_keys(call: cst.Call, ctx: RuleContext) -> frozenset[str]:
    """The keywords a ``**name`` splat of ``call`` certainly passes: ``name`` is assigned exactly once
    in the functions around the call, to a dict display of string keys, and the keys that any
    ``del name[...]`` / ``name.pop(...)`` there may remove are left out (a non-literal one leaves
    nothing); empty when unknown (another splat form, another binding, no context)."""
    splats = [arg.value for arg in call.args if arg.star == "**"]
    if len(splats) != 1 or not isinstance(splats[0], cst.Name):
        return frozenset()
    name = splats[0].value
    functions = [up for up in ctx.ancestors if isinstance(up, cst.FunctionDef)]
    if not functions:
        return frozenset()
    collector = _DictBinding(name)
    functions[-1].visit(collector)  # the outermost: it holds the nested ones (closures)
    if collector.other or len(collector.displays) != 1 or collector.removed is None:
        return frozenset()
    keys = [
        literal_string(element.key) if isinstance(element, cst.DictElement) else None
        for element in collector.displays[0].elements
    ]
    if any(key is None for key in keys):
        return frozenset()
    return frozenset(k for k in keys if k is not None) - collector.removed


class _DictBinding(cst.CSTVisitor):
    """The dict displays assigned to ``name``, whether anything else binds it, and the string keys
    ``del name[...]`` / ``name.pop(...)`` remove (None when one is not a literal)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.displays: list[cst.Dict] = []
        self.other = False
        self.removed: set[str] | None = set()

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            if isinstance(target.target, cst.Name) and target.target.value == self.name:
                dict_display = isinstance(node.value, cst.Dict) and all(
                    isinstance(e, cst.DictElement) for e in node.value.elements
                )
                if dict_display and len(node.targets) == 1:
                    self.displays.append(node.value)  # type: ignore[arg-type]
                else:
                    self.other = True

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.target, cst.Name) and node.target.value == self.name:
            self.other = True

    def visit_Param(self, node: cst.Param) -> None:
        if node.name.value == self.name:
            self.other = True

    def visit_Del(self, node: cst.Del) -> None:
        target = node.target
        if isinstance(target, cst.Subscript) and self._is_name(target.value):
            index = target.slice[0].slice if len(target.slice) == 1 else None
            self._remove(index.value if isinstance(index, cst.Index) else None)

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if (
            isinstance(func, cst.Attribute)
            and self._is_name(func.value)
            and func.attr.value in ("pop", "popitem", "clear")
        ):
            self._remove(node.args[0].value if func.attr.value == "pop" and node.args else None)

    def _is_name(self, node: cst.BaseExpression) -> bool:
        return isinstance(node, cst.Name) and node.value == self.name

    def _remove(self, key: cst.BaseExpression | None) -> None:
        text = literal_string(key) if key is not None else None
        if text is None or self.removed is None:
            self.removed = None
        else:
            self.removed.add(text)
