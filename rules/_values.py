"""Why a source API used as a value (not called) is not rewritten, said for the actual context.

Calls are ported one by one because their arguments state the semantics; a value escapes that:
whatever calls it later (a dispatch table lookup, a ``functools.partial``, an attribute anyone can
rebind, a callback parameter) is out of the rule's sight. Where flashport ships a signature-compatible
drop-in (``flashport.integrations.flash_attn_compat`` and the FA3/FA4 ones) the reason names it. Local aliases whose calls can be
resolved are ported by the engine (:mod:`flashport.rewriter.aliases`); everything else gets one of
these reasons.
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import RuleContext

_DROP_INS = {  # (module prefix, drop-in module, names it provides with the source's signature)
    "fa2": (
        "flashport.integrations.flash_attn_compat",
        (
            "flash_attn_func",
            "flash_attn_qkvpacked_func",
            "flash_attn_kvpacked_func",
            "flash_attn_varlen_func",
            "flash_attn_varlen_qkvpacked_func",
            "flash_attn_varlen_kvpacked_func",
            "flash_attn_unpadded_func",
            "flash_attn_unpadded_qkvpacked_func",
            "flash_attn_unpadded_kvpacked_func",
            "flash_attn_with_kvcache",
        ),
    ),
    "fa3": ("flashport.integrations.flash_attn3_compat", ("flash_attn_func", "flash_attn_varlen_func")),
    "fa4": ("flashport.integrations.flash_attn4_compat", ("flash_attn_func", "flash_attn_varlen_func")),
}


def _tail(api: str) -> str:
    """ "not rewritten", plus the drop-in to use by hand when flashport has one for ``api``."""
    name = api.rsplit(".", 1)[-1]
    family = (
        "fa4"
        if api.startswith("flash_attn.cute")
        else "fa3"
        if api.startswith(("flash_attn_interface", "flash_attn_3", "hopper"))
        else "fa2"
        if api.startswith("flash_attn.") and "triton" not in api
        else None
    )
    if family and name in _DROP_INS[family][1]:
        return f"not rewritten; {_DROP_INS[family][0]}.{name} is a drop-in with the same signature to use instead"
    return "not rewritten"


def _name(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_name(node.value)}.{node.attr.value}"
    return "..."


def describe(node: cst.BaseExpression, ctx: RuleContext) -> str:
    """One line: how ``node`` (a source API as a value) is used and why it stays."""
    tail = _tail(ctx.qualified_name or "")
    path = [a for a in ctx.ancestors]
    up = path[0] if path else None
    if isinstance(up, cst.DictElement):
        return f"entry of a dispatch table: calls through the table are out of sight; {tail}"
    if isinstance(up, cst.Element):
        return f"element of a list/tuple/set: calls through it are out of sight; {tail}"
    if isinstance(up, cst.Arg) and len(path) > 1 and isinstance(path[1], cst.Call):
        callee = _name(path[1].func)
        if callee.rsplit(".", 1)[-1] == "partial":
            return f"bound with {callee}(...): the arguments of the later calls are out of sight; {tail}"
        if callee.rsplit(".", 1)[-1] in (
            "signature",
            "getfullargspec",
            "getattr",
            "hasattr",
            "isinstance",
            "id",
        ):
            return f"inspected with {callee}(...) (a feature probe): not a call to port"
        return f"passed to {callee}(...) as a callback: its calls are out of sight; {tail}"
    if isinstance(up, cst.Assign):
        targets = [t.target for t in up.targets]
        if any(isinstance(t, cst.Attribute) for t in targets):
            return (
                f"stored in {_name(next(t for t in targets if isinstance(t, cst.Attribute)))}: an attribute can be "
                f"rebound from anywhere, so calls through it cannot be resolved; {tail}"
            )
        names_bound = [t.value for t in targets if isinstance(t, cst.Name)]
        if len(names_bound) == len(targets):
            names = ", ".join(names_bound)
            return (
                f"assigned to {names}, which is bound more than once, bound in a class, nested block or several "
                f"targets, or used as a value: calls through it do not resolve to this function alone; {tail}"
            )
    if isinstance(up, cst.Return):
        return f"returned as a value: its callers are out of sight; {tail}"
    return f"used as a value (callback, mapping or feature probe), not called: {tail}"
