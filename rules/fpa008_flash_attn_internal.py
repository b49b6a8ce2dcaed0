"""FPA008 flash-attn-triton-and-internals: flash-attn's private kernels -> flashport's drop-ins; Triton reported.

What it rewrites:
  the private kernel entry points of ``flash_attn.flash_attn_interface`` (ring / context-parallel
  attention and custom autograd functions call them): ``_flash_attn_forward`` /
  ``_flash_attn_backward``, ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` and
  their ``_wrapped_*`` variants, written against flash-attn >= 2.7 (the configured
  ``--flash-attn-version``, default 2.8.3), become the drop-in of the same name in
  ``flashport.integrations.flash_attn_compat`` (``flash_attn_private``): the call, its arguments,
  their order and comments unchanged. ``*args``/``**kwargs`` splats are bound at run time.

Semantics mapping:
  the drop-ins keep flash-attn 2.7+'s conventions: the forwards return ``(out, softmax_lse,
  S_dmask, rng_state)`` (lse [B, H, Sq] / varlen [H, total_q], +inf for a row that sees no key;
  ``S_dmask`` None; ``rng_state`` the dropout seed); the backwards write dq, dk, dv **into the given
  buffers** from the ``out`` and ``softmax_lse`` they are given (not a recomputed forward, so merged
  ring / two-branch results get flash-attn's gradients) and return ``softmax_d``. Causal/window
  bottom-right (per sequence for varlen), softcap, GQA, ALiBi (dense), dropout regenerated from
  ``rng_state`` in the backward.

What it refuses:
  * the private kernels when the configured flash-attn version is before 2.7 (they took
    ``window_size=(l, r)`` and the forwards returned 8 values), a call whose arguments do not bind
    to 2.7+'s signature (``window_size=``: an older version's branch), a forward unpacked into other
    than 4 names (an older version's return convention), ``return_softmax`` that may be true,
    varlen ``alibi_slopes``/``block_table``/``leftpad_k``/``seqused_k``, and value uses;
  * the Triton implementation ``flash_attn.flash_attn_triton.flash_attn_func(q, k, v, bias=None,
    causal=False, softmax_scale=None)`` and its ``flash_attn_kvpacked_func`` /
    ``flash_attn_qkvpacked_func``: same names as the CUDA functions (FPA001-003) but another
    signature -- the 4th positional argument is an additive ``bias``, not ``dropout_p`` -- so
    rewriting them as the CUDA function would change the meaning. Port by hand to
    ``flashport.torch.attention(q, k, v, bias=bias, causal=causal, scale=softmax_scale)`` once its
    causal alignment is checked.

Example::

    out, lse, _, rng = _flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
    # becomes
    out, lse, _, rng = flashport.integrations.flash_attn_compat._flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
"""

from __future__ import annotations

import re

import libcst as cst

from flashport.rules._flash_attn import COMPAT
from flashport.rules.base import (
    Refusal,
    Refuse,
    Rewrite,
    Rule,
    Signature,
    dotted,
    is_none,
    literal_bool,
    literal_string,
    register,
)

TRITON = tuple(
    f"flash_attn.flash_attn_triton.{name}"
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func")
)
PRIVATE = tuple(
    f"flash_attn.flash_attn_interface.{prefix}flash_attn{kind}_{step}"
    for prefix in ("_", "_wrapped_")
    for kind in ("", "_varlen")
    for step in ("forward", "backward")
)
PRIVATE_VERSION = (2, 7, 0)  # window_size_left/right and the 4-value forward return since 2.7.0
_WINDOW = ("window_size_left", "window_size_right", "softcap", "alibi_slopes")
_VARLEN = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_BACKWARD = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")
# flash-attn 2.8.3's parameter lists (flash_attn/flash_attn_interface.py)
SIGNATURES = {
    "_flash_attn_forward": Signature(
        ("q", "k", "v", "dropout_p", "softmax_scale", "causal", *_WINDOW, "return_softmax")
    ),
    "_flash_attn_varlen_forward": Signature(
        ("q", "k", "v", *_VARLEN, "dropout_p", "softmax_scale", "causal", *_WINDOW)
        + ("return_softmax", "block_table", "leftpad_k", "seqused_k", "zero_tensors")
    ),
    "_flash_attn_backward": Signature(
        (*_BACKWARD, "dropout_p", "softmax_scale", "causal", *_WINDOW, "deterministic", "rng_state")
    ),
    "_flash_attn_varlen_backward": Signature(
        (*_BACKWARD, *_VARLEN, "dropout_p", "softmax_scale", "causal", *_WINDOW)
        + ("deterministic", "rng_state", "zero_tensors")
    ),
}
_UNSUPPORTED_VARLEN = ("alibi_slopes", "block_table", "leftpad_k", "seqused_k")


@register
class FlashAttnTritonAndInternals(Rule):
    """Port flash-attn 2.7+'s private kernels to the drop-ins; report the Triton functions."""

    CODE = "FPA008"
    NAME = "flash-attn-triton-and-internals"
    API = "flash_attn.flash_attn_interface._flash_attn_forward"
    FRAMEWORK = "torch"
    SOURCES = TRITON + PRIVATE
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.integrations.flash_attn_compat._flash_attn_* (drop-ins)"

    def check_call(self, call, ctx):
        """The private kernels go to the drop-in of the same name; Triton calls are refused."""
        if ctx.qualified_name in TRITON:
            return Refusal(_triton_reason(ctx.qualified_name))
        function = ctx.qualified_name.rsplit(".", 1)[-1].replace("_wrapped", "", 1)
        version = ctx.options.flash_attn_version
        if _padded(version) < PRIVATE_VERSION:
            return Refusal(
                f"{function} before flash-attn 2.7 took window_size=(l, r) and its forward returned 8 "
                f"values; flashport's drop-in follows 2.7+ (configured {'.'.join(map(str, version))})"
            )
        branch = version_branch_below(ctx)
        if branch is not None and _padded(branch) <= PRIVATE_VERSION:
            return Refusal(
                f"{function} in a branch for flash-attn < {'.'.join(map(str, branch))}: written against an "
                "older private signature (window_size=(l, r), 8 return values) than the 2.7+ drop-in's"
            )
        if not any(arg.star for arg in call.args):
            _check_bound(SIGNATURES[function].bind(call, function), function)
        if function.endswith("_forward"):
            _check_unpacking(ctx, function)
        note = f"drop-in {function} (flash-attn 2.7+'s signature, return convention and in-place gradients)"
        return Rewrite(
            call.with_changes(func=dotted(f"{COMPAT}.{function}")), imports=(COMPAT,), notes=(note,)
        )

    def check_reference(self, node, ctx):
        """Value uses are reported: the callers of a value are out of sight."""
        if ctx.qualified_name in TRITON:
            return Refusal(f"used as a value: {_triton_reason(ctx.qualified_name)}")
        return Refusal(
            "used as a value: a private flash-attn kernel whose signature and return convention "
            "changed in 2.7; call flashport.integrations.flash_attn_compat's drop-in of the same name"
        )


def _padded(version: tuple[int, ...]) -> tuple[int, ...]:
    """``(2, 7)`` as ``(2, 7, 0)``: versions compare by release, whatever their length."""
    return tuple(version) + (0,) * (3 - len(version))


def _version_literal(node: cst.BaseExpression) -> tuple[int, ...] | None:
    """``"2.6.0"``, ``version.parse("2.6.0")``, ``Version("2.6.0")`` as a tuple of ints; else None."""
    if isinstance(node, cst.Call) and len(node.args) == 1:
        node = node.args[0].value
    text = literal_string(node)
    if text is None or not re.fullmatch(r"\d+(\.\d+)*", text):
        return None
    return tuple(int(part) for part in text.split("."))


def _upper_bound(test: cst.BaseExpression, negated: bool) -> tuple[int, ...] | None:
    """The flash-attn version a branch's test keeps it below (``v < X``, or ``not v >= X``)."""
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return None
    left, target = test.left, test.comparisons[0]
    bound, operator = _version_literal(target.comparator), target.operator
    if bound is None and (bound := _version_literal(left)) is not None:
        left = target.comparator
        flipped = {cst.GreaterThanEqual: cst.LessThanEqual, cst.GreaterThan: cst.LessThan}
        flipped.update({v: k for k, v in flipped.items()})
        operator = flipped.get(type(operator), type(operator))()
    if bound is None or "flash" not in cst.Module([]).code_for_node(left).lower():
        return None
    below = (cst.GreaterThanEqual, cst.GreaterThan) if negated else (cst.LessThan,)
    return bound if isinstance(operator, below) else None


def version_branch_below(ctx) -> tuple[int, ...] | None:
    """The lowest flash-attn version bound ``X`` such that the site runs only when the installed
    flash-attn (a name mentioning ``flash``) is below ``X``, from the ``if``/``elif``/``else`` tests
    around it; None when no such test is seen."""
    bounds = []
    child = ctx.node
    for up in ctx.ancestors:
        if isinstance(up, cst.If) and child is not up.test:
            bound = _upper_bound(up.test, negated=child is not up.body)
            if bound is not None:
                bounds.append(bound)
        child = up
    return min(bounds) if bounds else None


def _check_bound(bound: dict[str, cst.Arg], function: str) -> None:
    """Refuse what the drop-in would reject at run time."""
    if "return_softmax" in bound and literal_bool(bound["return_softmax"].value) is not False:
        raise Refuse(
            f"{function}(return_softmax=...) may be true: flash-attn's dropout-encoded probabilities "
            "are not reproduced"
        )
    if "varlen" in function:
        for name in _UNSUPPORTED_VARLEN:
            if name in bound and not is_none(bound[name].value):
                raise Refuse(f"{function}({name}=...): not supported by flashport's varlen drop-in")


def _check_unpacking(ctx, function: str) -> None:
    """A forward unpacked into other than 4 names was written for flash-attn < 2.7 (8 values)."""
    up = ctx.ancestors[0] if ctx.ancestors else None
    if isinstance(up, cst.Assign) and up.value is ctx.node:
        for target in up.targets:
            if isinstance(target.target, (cst.Tuple, cst.List)) and len(target.target.elements) != 4:
                raise Refuse(
                    f"{function}'s result is unpacked into {len(target.target.elements)} names: flash-attn "
                    "< 2.7's return convention (8 values), not the 4 of 2.7+ that the drop-in returns"
                )


def _triton_reason(name: str) -> str:
    short = name.rsplit(".", 1)[-1]
    return (
        f"flash_attn_triton.{short} is the Triton implementation: its 4th positional argument is an "
        "additive bias (not dropout_p), so it is not the CUDA function; port it by hand to "
        "flashport.torch.attention(q, k, v, bias=..., causal=..., scale=...)"
    )
