"""Shared helpers of the FlashAttention-3 (``flash_attn_interface``) and -4 (``flash_attn.cute``) rules.

Both keep FA2's layout, default scale and **bottom-right** causal/window, but: FA3's 4th positional
parameter is ``softmax_scale`` (FA2: ``dropout_p``) and its signature changed between releases, so
only the leading parameters that never moved may be positional; FA3's return type changed
(``(out, lse)`` always before 2025-07-11, then ``out``, then ``(out, lse)`` with
``return_attn_probs=True``) and FA4 spells "unbounded window" ``None`` and returns ``lse`` with
``return_lse``. Whether the caller expects a tuple is decided from how the result is used
(:func:`flashport.rules.common.node_context.result_usage`); when that is unknown the site is refused.
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite
from flashport.rules.common import node_context
from flashport.rules.common.calls import as_args, dotted, number, on_drop_in, string, tuple_of
from flashport.rules.common.literals import is_none, is_zero, literal_bool, literal_number
from flashport.rules.flash_attn import arguments as fa


def positional_limit(call: cst.Call, limit: int, reason: str) -> None:
    """Refuse (with ``reason``) a call with more than ``limit`` positional arguments."""
    if sum(1 for a in call.args if a.keyword is None and not a.star) > limit:
        raise Refuse(reason)


def refuse_set(value: dict, reasons: dict[str, str]) -> None:
    """Refuse when any argument named in ``reasons`` is given and not None."""
    for name, reason in reasons.items():
        if not is_none(value.get(name)):
            raise Refuse(reason)


def dropped_notes(value: dict, names: tuple[str, ...]) -> list[str]:
    """Notes for tuning-only arguments that the rewrite drops."""
    return [f"dropped {name}= (kernel tuning only)" for name in names if name in value]


def common(bound: dict[str, cst.Arg], ctx, api: str) -> tuple[list, list[str]]:
    """scale/causal/window(FA2 spelling)/softcap keywords plus ``align="bottom_right"``."""
    subset: dict[str, cst.Arg] = {
        n: bound[n] for n in ("softmax_scale", "causal", "window_size", "softcap") if n in bound
    }
    keywords, notes = fa.map_arguments(subset, ctx, api)
    keywords = [kw for kw in keywords if kw[0] != "align"]
    keywords.append(("align", string("bottom_right")))
    return keywords, notes


def fa4_window(node: cst.BaseExpression) -> cst.BaseExpression | None:
    """FA4 ``window_size=(l, r)`` (``None`` = unbounded; both ints with ``l + r < 0`` = unbounded).

    Raises:
      Refuse: for non-literal windows and one-sided negative values (their meaning differs by FA4 build).
    """
    if not (isinstance(node, (cst.Tuple, cst.List)) and len(node.elements) == 2):
        raise Refuse(
            "window_size is not a literal (l, r) pair: FA4's None/negative conventions cannot be mapped statically"
        )
    sides: list[int | None] = []
    for element in node.elements:
        if is_none(element.value):
            sides.append(None)
            continue
        v = literal_number(element.value)
        if not isinstance(v, int):
            raise Refuse("window_size is not a literal (l, r) pair of ints/None")
        sides.append(v)
    left, right = sides
    if left is not None and right is not None and left + right < 0:
        return None
    if any(s is not None and s < 0 for s in sides):
        raise Refuse(
            f"window_size={tuple(sides)} mixes a negative bound with a finite one; FA4 builds disagree on it"
        )
    if left is None and right is None:
        return None
    return tuple_of(*[cst.Name("None") if s is None else number(s) for s in sides])


def returns_tuple(call: cst.Call, ctx, flag: cst.BaseExpression | None, flag_name: str, history: str) -> bool:
    """Whether the rewritten call must return ``(out, lse)``.

    ``flag`` is the call's own return-lse argument: literal True -> tuple; literal False -> tensor;
    absent -> decided from the result's use; anything else, or an unknown use -> Refuse.
    """
    if flag is not None:
        value = literal_bool(flag)
        if value is None:
            raise Refuse(f"{flag_name}={ctx.code(flag)} is not a literal: the return type is unknown")
        return value
    usage = node_context.result_usage(call, ctx)
    if usage == "unknown":
        raise Refuse(
            f"{history}; how this result is used does not show which one the code expects "
            f"(index it, unpack it, or pass {flag_name}= explicitly)"
        )
    return usage == "tuple"


FA3_COMPAT = "flashport.integrations.flash_attn3_compat"


def fa3_tuple_drop_in(call: cst.Call, function: str, lse: str) -> Rewrite:
    """A FA3 call whose caller expects ``(out, lse)`` (``return_attn_probs=True``, or code written for
    the FA3 releases before 2025-07-11 that always returned the pair: it indexes or unpacks the
    result) on flashport's FA3 drop-in of the same name, with ``return_attn_probs=True`` added when
    the call lacks it: the drop-in then returns the same pair on every FA3 release's reading."""
    given = any(a.keyword is not None and a.keyword.value == "return_attn_probs" for a in call.args)
    args = list(call.args)
    if not given:
        args += as_args([], [("return_attn_probs", cst.Name("True"))])
        if len(args) > 1 and isinstance(args[-2].comma, cst.Comma):
            # a trailing comma: the new keyword takes it (and the closing parenthesis' layout), the
            # argument before it the separator the one before that used (the arguments' layout)
            before = args[-3].comma if len(args) > 2 and isinstance(args[-3].comma, cst.Comma) else None
            args[-1] = args[-1].with_changes(comma=args[-2].comma)
            args[-2] = args[-2].with_changes(
                comma=before or cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            )
        elif len(args) > 1:  # the separator the arguments already use (one a line stays one a line)
            before = args[-3].comma if len(args) > 2 and isinstance(args[-3].comma, cst.Comma) else None
            args[-2] = args[-2].with_changes(
                comma=before or cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            )
    note = f"drop-in {function} with return_attn_probs=True: returns (out, {lse}) as the caller expects"
    return Rewrite(
        call.with_changes(func=dotted(f"{FA3_COMPAT}.{function}"), args=args),
        imports=(FA3_COMPAT,),
        notes=(note,),
    )


def fa3_splat_drop_in(call: cst.Call, ctx, function: str) -> Rewrite | None:
    """A FA3 call with a ``*args``/``**kwargs`` splat (a thin wrapper ``def f(*args, **kwargs):
    out = fa3(*args, **kwargs)``) on flashport's FA3 drop-in of the same name, which binds the
    arguments at run time; None without a splat.

    The drop-in takes FA3's signature after 2025-07-11. Arguments bound by an older release's
    positions land on the drop-in's FP8/``qv``/``seqused`` parameters (which raise
    ``NotImplementedError``) or keep their meaning; older keyword names raise ``TypeError``. The
    return type is the one thing a splat cannot tell (``(out, lse)`` before 2025-07-11, ``out``
    after), so the result must be normalized right after the call
    (:func:`flashport.rules.common.node_context.tuple_normalized`).

    Raises:
      Refuse: for a splat whose result is used in any other way.
    """
    if not any(arg.star for arg in call.args):
        return None
    if not node_context.tuple_normalized(call, ctx):
        raise Refuse(
            "*args/**kwargs splat: flashport's FA3 drop-in would bind it at run time, but FA3 returned "
            "(out, lse) before 2025-07-11 and out after, and the code does not normalize the result "
            "(`out = f(*args, **kwargs)` then `if isinstance(out, tuple): return out[0]`)"
        )
    note = (
        f"drop-in {function} (FA3's signature): a *args/**kwargs splat is bound at run time; the result "
        "is normalized with isinstance(..., tuple), so FA3's return-type change does not matter"
    )
    return on_drop_in(call, f"{FA3_COMPAT}.{function}", note)


# ----------------------------------------------------------------------------------- FA3 (FPA010-FPA012)

FA3_MODULES = ("flash_attn_interface.", "flash_attn_3.flash_attn_interface.", "hopper.flash_attn_interface.")
FA3_KEYWORDS = (
    "qv",
    "q_descale",
    "k_descale",
    "v_descale",
    "descale_q",
    "descale_k",
    "descale_v",
    "window_size",
    "attention_chunk",
    "softcap",
    "num_splits",
    "pack_gqa",
    "deterministic",
    "sm_margin",
    "return_attn_probs",
    "sink_token_length",
    "gqa_parallel",
)
"""FA3 ``flash_attn_func``'s keyword parameters (FPA010; FPA011 adds its varlen ones)."""
FA3_UNSUPPORTED = {
    "qv": "qv (extra query projection for MLA) has no portable equivalent",
    **{
        name: "FP8 descale factors: flashport.attention has no FP8 path"
        for name in ("q_descale", "k_descale", "v_descale", "descale_q", "descale_k", "descale_v")
    },
}
FA3_TUNING = ("num_splits", "pack_gqa", "sm_margin", "deterministic", "gqa_parallel")
FA3_HISTORY = "FA3 flash_attn_func returned (out, lse) before 2025-07-11 and out after"


def fa3_sources(function: str) -> tuple[str, ...]:
    """Every import path of an FA3 function."""
    return tuple(m + function for m in FA3_MODULES)


def fa3_check_extras(value: dict, ctx) -> list[str]:
    """Refuse FA3-only features; return notes for dropped tuning arguments."""
    refuse_set(value, FA3_UNSUPPORTED)
    for name in ("attention_chunk", "sink_token_length"):
        if name in value and not is_zero(value[name]):
            raise Refuse(f"{name}={ctx.code(value[name])}: no portable equivalent (only 0 is accepted)")
    return dropped_notes(value, FA3_TUNING)


# ----------------------------------------------------------------------------------- FA4 (FPA013, FPA014)

FA4_MODULES = ("flash_attn.cute.", "flash_attn.cute.interface.")
FA4_KEYWORDS = (
    "qv",
    "gather_kv_indices",
    "softmax_scale",
    "causal",
    "window_size",
    "learnable_sink",
    "softcap",
    "num_splits",
    "pack_gqa",
    "deterministic",
    "score_mod",
    "score_mod_bwd",
    "mask_mod",
    "aux_tensors",
    "aux_scalars",
    "block_sparse_tensors",
    "block_sparse_tensors_bwd",
    "return_lse",
)
"""FA4 ``flash_attn_func``'s keyword parameters (FPA013; FPA014 adds its varlen ones)."""
FA4_UNSUPPORTED = {
    "qv": "qv (extra query projection for MLA) has no portable equivalent",
    "gather_kv_indices": "gather_kv_indices (sparse KV gather) has no portable equivalent",
    "learnable_sink": "learnable_sink (attention sinks) has no portable equivalent",
    "score_mod": "score_mod callables have no portable equivalent",
    "score_mod_bwd": "score_mod callables have no portable equivalent",
    "mask_mod": "mask_mod callables have no portable equivalent",
    "aux_tensors": "aux_tensors (for score_mod/mask_mod) have no portable equivalent",
    "aux_scalars": "aux_scalars (for score_mod/mask_mod) have no portable equivalent",
    "block_sparse_tensors": "block-sparse attention has no portable equivalent",
    "block_sparse_tensors_bwd": "block-sparse attention has no portable equivalent",
}
FA4_TUNING = ("num_splits", "pack_gqa", "deterministic")


def fa4_sources(function: str) -> tuple[str, ...]:
    """Every import path of an FA4 function."""
    return tuple(m + function for m in FA4_MODULES)


def fa4_keywords(bound, value, ctx, api) -> tuple[list, list[str]]:
    """Refuse FA4-only features; map scale/causal/window/softcap (FA4 window conventions)."""
    refuse_set(value, FA4_UNSUPPORTED)
    notes = dropped_notes(value, FA4_TUNING)
    plain = {n: bound[n] for n in ("softmax_scale", "causal", "softcap") if n in bound}
    keywords, more = common(plain, ctx, api)
    window = value.get("window_size")
    if not is_none(window):
        mapped = fa4_window(window)
        if mapped is not None:
            keywords.insert(2, ("window", mapped))
    return keywords, notes + more


__all__ = [
    "common",
    "dropped_notes",
    "fa3_check_extras",
    "fa3_sources",
    "fa3_splat_drop_in",
    "fa4_keywords",
    "fa4_sources",
    "fa4_window",
    "is_zero",
    "refuse_set",
    "returns_tuple",
]
