"""Shared helpers of the JAX-side catalogue rules (FPA202-FPA209).

Every JAX rule rewrites to ``flashport.attention(...)`` (or ``flashport.varlen_attention``) and states
``layout``, ``align`` and ``scale`` explicitly, because the source APIs disagree on all three
(layout: ``[B, S, H, D]`` for jax.nn, Pallas-GPU, flash-attn-jax and keras, ``sbhd`` possible in TE-JAX;
causal: top-left in jax.nn, Pallas-GPU ``mha`` and TE ``"causal"``, bottom-right in flash-attn-jax;
scale: ``1/sqrt(D)`` except cuDNN ``fused_attention_stablehlo`` (1.0) and Pallas-GPU ``mha``
(``sm_scale=1.0``)). These helpers convert the pieces that several source APIs share: flash-attn
style windows, enum members such as ``MaskType.CAUSAL``, dropout arguments and scales that must be
static.
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, RuleContext
from flashport.rules.common.calls import number, parenthesized, tuple_of
from flashport.rules.common.literals import is_none, literal_number
from flashport.rules.site import dotted_text

# Call prefixes whose result is an array (a tracer under jit), never a static Python float.
_ARRAY_NAMESPACES = ("jnp", "jax", "ops", "keras", "tf", "torch", "lax")


def none() -> cst.Name:
    """The literal ``None``."""
    return cst.Name("None")


def dotted_name(node: cst.CSTNode) -> str | None:
    """``a.b.c`` for a Name/Attribute chain (:func:`~flashport.rules.site.dotted_text`), else None."""
    return dotted_text(node) or None


def enum_member(node: cst.BaseExpression | None, enum: str, members: tuple[str, ...]) -> str | None:
    """The member name for ``<...>.{enum}.{MEMBER}`` (e.g. ``MaskType.CAUSAL``), else None."""
    name = dotted_name(node) if node is not None else None
    if name is None:
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] == enum and parts[-1] in members:
        return parts[-1]
    return None


def simple(node: cst.BaseExpression) -> bool:
    """True for a Name or attribute chain: safe to evaluate twice in the rewritten call."""
    return dotted_name(node) is not None


def fa_window(node: cst.BaseExpression, api: str) -> cst.BaseExpression | None:
    """flash-attn style ``window_size=(left, right)`` (negative = unbounded) as the contract's window.

    Returns None when both sides are unbounded (no window). Only literal pairs are mapped.

    Raises:
      Refuse: for a window that is not a literal pair of ints.
    """
    if isinstance(node, (cst.Tuple, cst.List)) and len(node.elements) == 2:
        values = [v for e in node.elements if isinstance(v := literal_number(e.value), int)]
        if len(values) == 2:
            if all(v < 0 for v in values):
                return None
            return tuple_of(*[none() if v < 0 else number(v) for v in values])
    raise Refuse(f"window_size of {api} is not a literal (left, right) pair of ints")


def static_scale(
    node: cst.BaseExpression | None, default: cst.BaseExpression, ctx: RuleContext, name: str
) -> cst.BaseExpression:
    """The ``scale=`` value for the contract: ``default`` when absent/None, else the expression.

    Raises:
      Refuse: when the expression is computed with array ops (a tracer under jit): the contract
        needs a static Python float.
    """
    if node is None or is_none(node):
        return default
    if _calls_array_namespace(node):
        raise Refuse(
            f"{name}={ctx.code(node)} is computed with array ops (a traced value under jit); flashport.attention needs a static Python float"
        )
    return node


def _calls_array_namespace(node: cst.CSTNode) -> bool:
    found = []

    class _Finder(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> bool:
            name = dotted_name(call.func)
            if name is not None and "." in name and name.split(".")[0] in _ARRAY_NAMESPACES:
                found.append(name)
            return True

    node.visit(_Finder())
    return bool(found)


def require(
    value: dict[str, cst.BaseExpression], names: tuple[str, ...], api: str
) -> list[cst.BaseExpression]:
    """The values of required arguments, or Refuse naming the missing one."""
    missing = [name for name in names if name not in value]
    if missing:
        raise Refuse(f"{api} call without {missing[0]!r}")
    return [value[name] for name in names]


def literal_false(node: cst.BaseExpression | None) -> bool:
    """True for an absent argument, ``False`` or ``None`` (a flag that is off)."""
    return node is None or (isinstance(node, cst.Name) and node.value in ("False", "None"))


def subscript(node: cst.BaseExpression, *indices: str) -> cst.Subscript:
    """``node[i0, i1, ...]`` where each index is source text (``":"``, ``"None"``, ``"0"``)."""
    template = cst.ensure_type(cst.parse_expression(f"__x__[{', '.join(indices)}]"), cst.Subscript)
    return template.with_changes(value=parenthesized(node))


def fa_keywords(
    value: dict[str, cst.BaseExpression], ctx: RuleContext, api: str
) -> list[tuple[str, cst.BaseExpression]]:
    """flash-attn style ``softmax_scale``/``is_causal``/``window_size`` as contract keywords.

    flash-attn forks (flash-attn-jax) keep FA2's conventions: ``softmax_scale=None`` = 1/sqrt(D),
    causal and window bottom-right aligned, ``-1`` = unbounded window side.
    """
    keywords: list[tuple[str, cst.BaseExpression]] = [
        ("scale", static_scale(value.get("softmax_scale"), none(), ctx, "softmax_scale")),
        ("causal", value.get("is_causal", cst.Name("False"))),
    ]
    window = value.get("window_size")
    if window is not None:
        mapped = fa_window(window, api)
        if mapped is not None:
            keywords.append(("window", mapped))
    return keywords
