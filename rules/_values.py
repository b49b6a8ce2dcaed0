"""Why a source API used as a value (not called) is not rewritten, said for the actual context.

Calls are ported one by one because their arguments state the semantics; a value escapes that:
whatever calls it later (a dispatch table lookup, a ``functools.partial``, an attribute anyone can
rebind, a callback parameter) is out of the rule's sight, and flashport ships no signature-compatible
drop-in of flash-attn's functions to substitute for the value. Local aliases whose calls can be
resolved are ported by the engine (:mod:`flashport.rewriter.aliases`); everything else gets one of
these reasons.
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import RuleContext

_TAIL = "not rewritten (flashport has no signature-compatible drop-in to put in its place)"


def _name(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_name(node.value)}.{node.attr.value}"
    return "..."


def describe(node: cst.BaseExpression, ctx: RuleContext) -> str:
    """One line: how ``node`` (a source API as a value) is used and why it stays."""
    path = [a for a in ctx.ancestors]
    up = path[0] if path else None
    if isinstance(up, cst.DictElement):
        return f"entry of a dispatch table: calls through the table are out of sight; {_TAIL}"
    if isinstance(up, cst.Element):
        return f"element of a list/tuple/set: calls through it are out of sight; {_TAIL}"
    if isinstance(up, cst.Arg) and len(path) > 1 and isinstance(path[1], cst.Call):
        callee = _name(path[1].func)
        if callee.rsplit(".", 1)[-1] == "partial":
            return f"bound with {callee}(...): the arguments of the later calls are out of sight; {_TAIL}"
        if callee.rsplit(".", 1)[-1] in ("signature", "getfullargspec", "getattr", "hasattr", "isinstance", "id"):
            return f"inspected with {callee}(...) (a feature probe): not a call to port"
        return f"passed to {callee}(...) as a callback: its calls are out of sight; {_TAIL}"
    if isinstance(up, cst.Assign):
        targets = [t.target for t in up.targets]
        if any(isinstance(t, cst.Attribute) for t in targets):
            return (f"stored in {_name(next(t for t in targets if isinstance(t, cst.Attribute)))}: an attribute can be "
                    f"rebound from anywhere, so calls through it cannot be resolved; {_TAIL}")
        if all(isinstance(t, cst.Name) for t in targets):
            names = ", ".join(t.value for t in targets)
            return (f"assigned to {names}, which is bound more than once, bound in a class, nested block or several "
                    f"targets, or used as a value: calls through it do not resolve to this function alone; {_TAIL}")
    if isinstance(up, cst.Return):
        return f"returned as a value: its callers are out of sight; {_TAIL}"
    return f"used as a value (callback, mapping or feature probe), not called: {_TAIL}"
