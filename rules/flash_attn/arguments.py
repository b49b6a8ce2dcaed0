"""Shared helpers of the flash-attn 2.x rules: per-version signatures and the argument mapping.

flash-attn inserted parameters mid-signature over 2.x (window_size 2.3, alibi_slopes 2.4,
deterministic 2.4.1, softcap 2.6 *before* alibi_slopes; block_table 2.5.7 for varlen), so positional
arguments are bound against the signature of the configured version
(``RuleOptions.flash_attn_version``, default 2.8.3). ``causal`` is bottom-right since 2.1 and
top-left in 2.0 and 1.x. The flash-attn 1.x varlen names (``flash_attn_unpadded_*``) are bound
with 1.x's argument order and top-left alignment whatever the configured version.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as matchers

from flashport.rules.apis import flash_attn as apis_flash_attn
from flashport.rules.base import Refuse, Rewrite, RuleContext
from flashport.rules.common.binding import Signature, carry_dropout, no_dropout
from flashport.rules.common.calls import (
    insert_in_source_order,
    number,
    on_drop_in,
    parenthesized,
    string,
    tuple_of,
)
from flashport.rules.common.literals import (
    is_none,
    is_zero,
    literal_bool,
    literal_number,
    training_gated_zero,
)
from flashport.rules.common.node_context import simple

FLASH_ATTN_MODULES = apis_flash_attn.MODULES


def sources(function: str) -> tuple[str, ...]:
    """Every public import path of a flash-attn 2.x function."""
    return tuple(m + function for m in FLASH_ATTN_MODULES)


def sources_with_fa1(function: str) -> tuple[str, ...]:
    """:func:`sources`, then the import paths of the function's flash-attn 1.x name, if it had one
    (``flash_attn_unpadded_*`` for ``flash_attn_varlen_*``)."""
    fa1 = apis_flash_attn.FA1_NAMES.get(function)
    return sources(function) + (fa1_sources(fa1) if fa1 else ())


PACKED = ("qkv", "kv")
"""The leading parameters that pack several tensors along one dimension."""


def split_packed(leading: tuple[str, ...], values: list, dim: int) -> list:
    """``values`` of the first parameters of ``leading``, each packed one split once (:func:`unbind`)."""
    return [
        unbind(value, dim) if name in PACKED else value for name, value in zip(leading, values, strict=False)
    ]


def tail(version: tuple[int, ...]) -> tuple[str, ...]:
    """The parameters after the tensors (and cu_seqlens) at ``version`` (from the API catalogue)."""
    return apis_flash_attn.fa2_tail(version)


def signature(leading: tuple[str, ...], version: tuple[int, ...], varlen: bool = False) -> Signature:
    """The full positional signature of a flash-attn function at ``version``."""
    names = leading + tail(version)
    if varlen and version >= (2, 5, 7):
        names += ("block_table",)
    return Signature(names)


FA1_VERSION = apis_flash_attn.FA1_RELEASE
FA1_MODULES = ("flash_attn.flash_attn_interface.",)


def fa1_sources(function: str) -> tuple[str, ...]:
    """Import paths of a flash-attn 1.x function (renamed ``flash_attn_varlen_*`` in 2.0)."""
    return tuple(m + function for m in FA1_MODULES)


def is_fa1(qualified_name: str) -> bool:
    """Whether ``qualified_name`` is a flash-attn 1.x ``flash_attn_unpadded_*`` name."""
    return qualified_name.rsplit(".", 1)[-1].startswith("flash_attn_unpadded")


def varlen_signature(
    leading: tuple[str, ...], qualified_name: str, version: tuple[int, ...]
) -> tuple[Signature, tuple[int, ...]]:
    """(signature, version) for a varlen call: flash-attn 1.x order for the ``flash_attn_unpadded_*``
    names (``dropout_p`` required, ``return_attn_probs`` before ``deterministic``; tag v1.0.9),
    else :func:`signature` at ``version``. Only 1.x has those names, so their version is fixed."""
    if is_fa1(qualified_name):
        return Signature(
            leading + ("dropout_p", "softmax_scale", "causal", "return_attn_probs", "deterministic")
        ), FA1_VERSION
    return signature(leading, version, varlen=True), version


def align(version: tuple[int, ...]) -> str:
    """Causal/window alignment of flash-attn ``version``."""
    return "top_left" if version < (2, 1) else "bottom_right"


def _window(node: cst.BaseExpression) -> cst.BaseExpression | None:
    """flash-attn ``window_size=(left, right)`` (-1 = unbounded) as the contract's ``window``."""
    if (
        isinstance(node, (cst.Tuple, cst.List))
        and len(node.elements) == 2
        and all(type(e) is cst.Element for e in node.elements)
    ):
        values = [v for e in node.elements if isinstance(v := literal_number(e.value), int)]
        if len(values) == 2:
            if all(v < 0 for v in values):
                return None
            return tuple_of(*[cst.Name("None") if v < 0 else number(v) for v in values])
        sides = [_window_side(e.value) for e in node.elements]
        if all(side is not None for side in sides):  # readable: one conditional per side that needs it
            return tuple_of(*[side for side in sides if side is not None])
    # Dynamic: convert at run time, once (the iterable of a generator is evaluated in this scope;
    # an assignment expression may not stand there, so a value holding one is passed to a lambda).
    if matchers.findall(node, matchers.NamedExpr()):
        template = "(lambda window: tuple(None if w is None or w < 0 else w for w in window))(__window__)"
    else:
        template, node = "tuple(None if w is None or w < 0 else w for w in __window__)", parenthesized(node)
    converted = cst.parse_expression(template).visit(_Substitute("__window__", node))
    if not isinstance(converted, cst.BaseExpression):  # the substitution replaces one name by one expression
        raise TypeError(f"window conversion produced {type(converted).__name__}, not an expression")
    return converted


def _window_side(node: cst.BaseExpression) -> cst.BaseExpression | None:
    """One side of a flash-attn window as the contract's: a literal as its value (-1 -> None), a name
    or attribute as ``None if x < 0 else x`` (read twice: :func:`simple`); None for anything else."""
    value = literal_number(node)
    if isinstance(value, int):
        return cst.Name("None") if value < 0 else number(value)
    if not simple(node):
        return None
    return cst.IfExp(
        test=cst.Comparison(node, [cst.ComparisonTarget(cst.LessThan(), cst.Integer("0"))]),
        body=cst.Name("None"),
        orelse=node.deep_clone(),  # the same expression, read a second time
    )


class _Substitute(cst.CSTTransformer):
    def __init__(self, name: str, node: cst.BaseExpression):
        super().__init__()
        self.name, self.node = name, node

    def leave_Name(self, original_node, updated_node):
        return self.node if updated_node.value == self.name else updated_node


VARLEN_NO_DROPOUT = (
    "flashport.varlen_attention has no dropout (port by hand with flashport.torch.attention and segment ids)"
)


def _refuse_unsupported(value: dict[str, cst.BaseExpression]) -> list[str]:
    """Refuse what the contract cannot express (ALiBi, ``return_attn_probs``, paged KV); returns the
    note for a dropped ``deterministic``.

    Raises:
      Refuse: naming the argument.
    """
    if not is_none(value.get("alibi_slopes")):
        raise Refuse("alibi_slopes: flash-attn's symmetric ALiBi bias has no portable equivalent here")
    probs = value.get("return_attn_probs")
    if probs is not None and literal_bool(probs) is not False:
        raise Refuse("return_attn_probs: the (out, softmax_lse, S_dmask) tuple cannot be reproduced")
    if not is_none(value.get("block_table")):
        raise Refuse("block_table (paged KV cache) has no portable equivalent")
    deterministic = value.get("deterministic")
    if deterministic is not None and literal_bool(deterministic) is not False:
        return ["dropped deterministic= (it only affects flash-attn's backward pass)"]
    return []


def _softcap(softcap: cst.BaseExpression) -> cst.BaseExpression:
    """flash-attn's ``softcap`` (0.0 = off) as the contract's (None = off): a literal as is, an
    expression as ``softcap or None``.

    Raises:
      Refuse: for a negative literal.
    """
    literal = literal_number(softcap)
    if literal is not None and literal < 0:
        raise Refuse(f"softcap={literal} is negative")
    if literal is not None:
        return softcap
    if isinstance(softcap, (cst.BooleanOperation, cst.IfExp, cst.Lambda)):
        softcap = softcap.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.BooleanOperation(left=softcap, operator=cst.Or(), right=cst.Name("None"))


def map_arguments(
    bound: dict[str, cst.Arg],
    ctx: RuleContext,
    api: str,
    version: tuple[int, ...] | None = None,
    dropout: bool = True,
) -> tuple[list[tuple[str, cst.BaseExpression]], list[str]]:
    """Map flash-attn keyword arguments to the contract's; returns (keywords, notes). ``version``
    (default: the configured ``flash_attn_version``) decides the causal alignment.

    ``dropout_p`` is not among the keywords: with ``dropout=True`` (a ``flashport.torch.attention``
    target) the rule carries it with :func:`add_dropout`; with ``dropout=False`` (the varlen target,
    which has no dropout) a dropout that may be non-zero is refused here.

    Raises:
      Refuse: for dropout the target cannot take, ALiBi, return_attn_probs, paged KV.
    """
    value = {name: arg.value for name, arg in bound.items()}
    notes: list[str] = []
    if not dropout:
        notes.extend(no_dropout(value.get("dropout_p"), "dropout_p", ctx, VARLEN_NO_DROPOUT))
    notes.extend(_refuse_unsupported(value))
    scale = value.get("softmax_scale")
    keywords: list[tuple[str, cst.BaseExpression]] = [
        ("scale", cst.Name("None") if scale is None or is_none(scale) else scale),
        ("causal", value.get("causal", cst.Name("False"))),
    ]
    window = value.get("window_size")
    if window is not None and not is_none(window):
        mapped = _window(window)
        if mapped is not None:
            keywords.append(("window", mapped))
    softcap = value.get("softcap")
    if softcap is not None and not is_zero(softcap):
        keywords.append(("softcap", _softcap(softcap)))
    keywords.append(("align", string(align(version or ctx.options.flash_attn_version))))
    return keywords, notes


def add_dropout(
    call: cst.Call, positional: list, keywords: list, bound: dict[str, cst.Arg], ctx: RuleContext
) -> tuple[list, list[str]]:
    """``keywords`` with flash-attn's ``dropout_p`` carried over verbatim as the contract's
    ``dropout_p`` (same meaning: dropout on the normalized probabilities, kept ones scaled by
    1/(1-p), applied whenever p > 0), placed in its source evaluation order; returns
    (keywords, notes). A literal 0 is dropped, and so is a training-gated one under ``--inference``.

    Raises:
      Refuse: for an impure dropout expression that cannot keep its evaluation order.
    """
    node = bound["dropout_p"].value if "dropout_p" in bound else None
    entries, notes = carry_dropout(node, "dropout_p", "dropout_p", ctx)
    for entry in entries:
        keywords = insert_in_source_order(call, positional, keywords, entry, "dropout_p", ctx)
    return keywords, notes


COMPAT = "flashport.integrations.flash_attn_compat"


def varlen_drop_in(
    call: cst.Call, bound: dict[str, cst.Arg], ctx: RuleContext, leading: int
) -> Rewrite | None:
    """A varlen call whose dropout may be non-zero, that reads a paged KV cache (``block_table``) or
    adds ALiBi (``alibi_slopes``), on flashport's drop-in of the same name
    (``flash_attn_compat.flash_attn_varlen_func``..., flash-attn's signature, dropout passed to the
    contract, pages gathered through ``block_table``, ALiBi added per sequence as flash-attn's
    kernel adds it): ``flashport.varlen_attention`` has none of them. The call keeps its arguments,
    so evaluation order and comments are unchanged.

    Returns None when the usual rewrite applies (no dropout or dropped by ``--inference``, no
    ``block_table``, no ALiBi) or when the usual refusal should name the blocker
    (``return_attn_probs`` with dropout, flash-attn 2.0's top-left causal, which the 2.x drop-ins
    do not follow).

    Raises:
      Refuse: for 2.x positional arguments after ``dropout_p`` (their order changed between releases).
    """
    node = bound["dropout_p"].value if "dropout_p" in bound else None
    live = not (node is None or is_zero(node) or (training_gated_zero(node) and ctx.options.inference))
    paged = "block_table" in bound and not is_none(bound["block_table"].value)
    alibi = "alibi_slopes" in bound and not is_none(bound["alibi_slopes"].value)
    if not (live or paged or alibi):
        return None
    probs = bound["return_attn_probs"].value if "return_attn_probs" in bound else None
    if probs is not None and literal_bool(probs) is not False and (live or not alibi):
        return None  # S_dmask with dropout is not reproduced; without dropout probs_drop_in takes it
    if not is_fa1(ctx.qualified_name) and ctx.options.flash_attn_version < (2, 1):
        return None
    if live and node is not None:
        what = f"dropout_p={ctx.code(node)}"
    else:
        what = "alibi_slopes (ALiBi)" if alibi else "block_table (paged KV cache)"
    positional = sum(1 for arg in call.args if arg.keyword is None)
    if not is_fa1(ctx.qualified_name) and positional > leading + 1:
        raise Refuse(
            f"{what}: flashport.varlen_attention does not take it, and the drop-in takes flash-attn "
            "2.8's argument order; pass the arguments after dropout_p by keyword"
        )
    function = ctx.qualified_name.rsplit(".", 1)[-1]
    if live:
        passed = "dropout_p passed to the contract"
    else:
        passed = (
            "ALiBi added per sequence as flash-attn's kernel adds it"
            if alibi
            else "pages gathered through block_table"
        )
    note = f"drop-in {function} (flash-attn's signature; {passed}): flashport.varlen_attention does not take {what.split('=')[0]}"
    return on_drop_in(call, f"{COMPAT}.{function}", note)


def dense_drop_in(call: cst.Call, ctx: RuleContext, leading: int, why: str) -> Rewrite | None:
    """The call itself on flashport's drop-in of the same name (``flash_attn_compat.flash_attn_func``...:
    flash-attn 2.8's signature and semantics, ALiBi and dropout included): arguments, their
    evaluation order and comments unchanged. ``why`` goes into the note.

    Returns None for flash-attn 2.0 (top-left causal; the drop-in is bottom-right).

    Raises:
      Refuse: for positional arguments after ``window_size`` before flash-attn 2.6 (``softcap`` was
        inserted before ``alibi_slopes`` in 2.6; the drop-in follows 2.8).
    """
    version = ctx.options.flash_attn_version
    if version < (2, 1):
        return None
    if version < (2, 6) and sum(1 for arg in call.args if arg.keyword is None) > leading + 4:
        raise Refuse(
            f"{why}, and the drop-in follows flash-attn 2.8's argument order: pass the arguments "
            "after window_size by keyword"
        )
    function = ctx.qualified_name.rsplit(".", 1)[-1]
    note = f"drop-in {function} (flash-attn's signature and semantics): {why}"
    return on_drop_in(call, f"{COMPAT}.{function}", note)


def splat_drop_in(call: cst.Call, ctx: RuleContext) -> Rewrite | None:
    """A call with a ``*args``/``**kwargs`` splat on flashport's drop-in of the same name
    (``flash_attn_compat.flash_attn_func``...: flash-attn 2.8's signature, or 1.x's for the
    ``flash_attn_unpadded_*`` names), which binds the arguments at run time as flash-attn does.
    None without a splat, and for flash-attn 2.0 (top-left causal; the 2.x drop-ins are bottom-right).

    Raises:
      Refuse: for a ``*args`` splat before flash-attn 2.6 (``softcap`` was inserted mid-signature in
        2.6; the drop-in follows 2.8's positions).
    """
    if not any(arg.star for arg in call.args):
        return None
    if not is_fa1(ctx.qualified_name):
        version = ctx.options.flash_attn_version
        if version < (2, 1):
            return None
        if version < (2, 6) and any(arg.star == "*" for arg in call.args):
            raise Refuse(
                "*args splat: the parameters it fills moved in flash-attn 2.6 (softcap) and the drop-in "
                "follows 2.8's positions; pass them by keyword"
            )
    function = ctx.qualified_name.rsplit(".", 1)[-1]
    note = f"drop-in {function} (flash-attn's signature and semantics): a *args/**kwargs splat is bound at run time"
    return on_drop_in(call, f"{COMPAT}.{function}", note)


def alibi_drop_in(
    call: cst.Call, bound: dict[str, cst.Arg], ctx: RuleContext, leading: int
) -> Rewrite | None:
    """A dense call with ``alibi_slopes`` on the drop-in (:func:`dense_drop_in`), which adds
    flash-attn's ALiBi bias as its kernel does. None without ALiBi, or when the usual refusal should
    stand (``return_attn_probs``, flash-attn 2.0)."""
    if "alibi_slopes" not in bound or is_none(bound["alibi_slopes"].value):
        return None
    probs = bound["return_attn_probs"].value if "return_attn_probs" in bound else None
    if probs is not None and literal_bool(probs) is not False:
        return None
    return dense_drop_in(call, ctx, leading, "alibi_slopes (ALiBi bias added as flash-attn's kernel adds it)")


def probs_drop_in(
    call: cst.Call, bound: dict[str, cst.Arg], ctx: RuleContext, leading: int
) -> Rewrite | None:
    """A flash-attn 2.x call whose ``return_attn_probs`` may be true, without dropout, on the drop-in
    of the same name (:func:`dense_drop_in`). flash-attn fills ``S_dmask`` only when ``dropout_p > 0``
    (its kernel refuses the probabilities otherwise and the Python wrapper returns an empty tensor),
    so without dropout its ``(out, softmax_lse, S_dmask)`` is reproduced exactly: the drop-in returns
    the same empty tensor. None when the flag is absent or literally False, when ``dropout_p`` may be
    non-zero (the refusal stands), for ALiBi on a varlen call (:func:`varlen_drop_in` decides those)
    and for the flash-attn 1.x names."""
    probs = bound["return_attn_probs"].value if "return_attn_probs" in bound else None
    dropout = bound["dropout_p"].value if "dropout_p" in bound else None
    if probs is None or literal_bool(probs) is False or is_fa1(ctx.qualified_name):
        return None
    dropout_live = dropout is not None and not is_zero(dropout)
    if dropout_live and not s_dmask_unused(ctx):
        return None
    if (
        "varlen" in ctx.qualified_name
        and "alibi_slopes" in bound
        and not is_none(bound["alibi_slopes"].value)
    ):
        return None
    why = (
        "return_attn_probs with a dropout, S_dmask unused (the drop-in returns None for it)"
        if dropout_live
        else "return_attn_probs without dropout (S_dmask: flash-attn's empty tensor)"
    )
    return dense_drop_in(call, ctx, leading, why)


def s_dmask_unused(ctx: RuleContext) -> bool:
    """The call's third value (``S_dmask``) is never read: the result is unpacked into ``out, lse, _``
    (a ``_``-prefixed name) or ``out, lse, *_``, or indexed ``[0]`` / ``[1]``."""
    up = ctx.ancestors[0] if ctx.ancestors else None
    if isinstance(up, cst.Assign) and up.value is ctx.node and len(up.targets) == 1:
        target = up.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 3:
            last = target.elements[2].value  # the name, starred or not
            return isinstance(last, cst.Name) and last.value.startswith("_")
    if isinstance(up, cst.Subscript) and up.value is ctx.node and len(up.slice) == 1:
        index = up.slice[0].slice
        return isinstance(index, cst.Index) and literal_number(index.value) in (0, 1)
    return False


def dropout_or_drop_in(
    call: cst.Call,
    positional: list,
    keywords: list,
    bound: dict[str, cst.Arg],
    ctx: RuleContext,
    leading: int,
) -> tuple[list, list[str]] | Rewrite:
    """:func:`add_dropout`, or, when the dropout expression cannot keep its evaluation order in the
    explicit rewrite, the drop-in call (:func:`dense_drop_in`), which keeps every argument in place.

    Raises:
      Refuse: when neither applies.
    """
    try:
        return add_dropout(call, positional, keywords, bound, ctx)
    except Refuse:
        drop_in = dense_drop_in(
            call, ctx, leading, "dropout_p keeps its place among arguments with side effects"
        )
        if drop_in is None:
            raise
        return drop_in


def unbind(node: cst.BaseExpression, dim: int) -> cst.Arg:
    """``*node.unbind(dim)``: split a packed qkv/kv tensor, evaluating ``node`` once."""
    call = cst.Call(
        func=cst.Attribute(value=parenthesized(node), attr=cst.Name("unbind")),
        args=[cst.Arg(value=cst.Integer(str(dim)))],
    )
    return cst.Arg(value=call, star="*")
