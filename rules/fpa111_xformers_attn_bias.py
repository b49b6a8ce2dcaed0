"""FPA111 xformers-attn-bias: xformers ``attn_bias`` constructors -> flashport's mirror classes.

What it rewrites:
  calls that build a bias: ``LowerTriangularMask()``, ``LowerTriangularMaskWithTensorBias(b)``,
  ``LowerTriangularFromBottomRightMask()``, ``LowerTriangularFromBottomRightLocalAttentionMask(w)``,
  ``LocalAttentionFromBottomRightMask(l, r)``, ``BlockDiagonalMask.from_seqlens(q, kv)`` /
  ``.from_tensor_list(ts)`` and the same for ``BlockDiagonalCausalMask`` and
  ``BlockDiagonalCausalFromBottomRightMask``, from ``xformers.ops``, ``xformers.ops.fmha`` or
  ``xformers.ops.fmha.attn_bias``. Only the callee changes (to
  ``flashport.integrations.xformers_compat.<same name>``); the arguments and any chained
  ``.make_causal()`` / ``.make_local_attention(w)`` / ``.add_bias(t)`` / ``.split(out)`` stay.

Semantics mapping:
  the mirror classes record the same meaning (top-left vs bottom-right causal, window, block
  lengths) and ``memory_efficient_attention`` (FPA110) turns them into contract keywords; see
  ``flashport/integrations/xformers_compat.py``. Block lengths may be dynamic Python ints (they
  become segment ids at run time).

What it refuses:
  padded/paged/gappy block masks (``BlockDiagonalPaddedKeysMask``,
  ``BlockDiagonalCausalWithOffsetPaddedKeysMask``, ``BlockDiagonalGappyKeysMask``,
  ``Paged...``, ``BlockDiagonalCausalWithOffsetGappyKeysMask``) and ``from_tensor_lists_qkv``:
  their layouts (padding inside blocks, page tables) are not representable. Every constructor in
  a file where some ``memory_efficient_attention`` call is refused (by FPA110): a bias object
  built here could reach that call, which still runs xformers and needs xformers' own classes.

Example::

    bias = fmha.BlockDiagonalMask.from_seqlens([3, 5]).make_causal()
    # becomes
    bias = flashport.integrations.xformers_compat.BlockDiagonalMask.from_seqlens([3, 5]).make_causal()
"""

from __future__ import annotations

import libcst as cst

from flashport.rules import _sites
from flashport.rules.base import Refusal, Refuse, Rewrite, Rule, dotted, register

MODULE = "flashport.integrations.xformers_compat"
PREFIXES = ("xformers.ops.", "xformers.ops.fmha.", "xformers.ops.fmha.attn_bias.")
PLAIN = ("LowerTriangularMask", "LowerTriangularMaskWithTensorBias", "LowerTriangularFromBottomRightMask",
         "LowerTriangularFromBottomRightLocalAttentionMask", "LocalAttentionFromBottomRightMask")
BLOCKS = ("BlockDiagonalMask", "BlockDiagonalCausalMask", "BlockDiagonalCausalFromBottomRightMask")
CONSTRUCTORS = ("from_seqlens", "from_tensor_list")
UNSUPPORTED = ("BlockDiagonalPaddedKeysMask", "BlockDiagonalCausalWithOffsetPaddedKeysMask",
               "BlockDiagonalGappyKeysMask", "BlockDiagonalCausalWithOffsetGappyKeysMask",
               "PagedBlockDiagonalPaddedKeysMask", "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",
               "PagedBlockDiagonalGappyKeysMask", "PagedBlockDiagonalCausalWithOffsetGappyKeysMask")

_SUPPORTED = PLAIN + tuple(f"{b}.{c}" for b in BLOCKS for c in CONSTRUCTORS)
_REFUSED = tuple(f"{u}.{c}" for u in UNSUPPORTED for c in CONSTRUCTORS) + UNSUPPORTED + tuple(
    f"{b}.from_tensor_lists_qkv" for b in BLOCKS)


@register
class XformersAttnBias(Rule):
    """Point xformers ``attn_bias`` constructors at flashport's mirror classes."""

    CODE = "FPA111"
    NAME = "xformers-attn-bias"
    API = "xformers.ops.fmha.attn_bias"
    FRAMEWORK = "torch"
    SOURCES = tuple(p + n for n in _SUPPORTED + _REFUSED for p in PREFIXES)
    TRIGGERS = (b"xformers",)
    GPU_MODULES = ("xformers",)
    TARGET = MODULE + ".<class>"

    def check_call(self, call, ctx):
        """Swap the callee for the mirror class; refuse padded/paged/gappy layouts."""
        name = next(ctx.qualified_name[len(p):] for p in sorted(PREFIXES, key=len, reverse=True)
                    if ctx.qualified_name.startswith(p))
        if name not in _SUPPORTED:
            return Refusal(f"{name}: padded, paged or gappy block layouts have no flashport equivalent")
        why = refused_attention_call(ctx)
        if why:
            return Refusal(f"a memory_efficient_attention call in this file stays xformers ({why}); its biases must stay xformers' classes")
        return Rewrite(call.with_changes(func=dotted(f"{MODULE}.{name}")), imports=(MODULE,))


def refused_attention_call(ctx) -> str | None:
    """Why some ``memory_efficient_attention*`` call of the file is not rewritten by FPA110 (None: all are)."""
    from flashport.rules.fpa110_xformers_memory_efficient_attention import REPORTED, XformersMemoryEfficientAttention

    module = _sites._module(ctx)
    if module is None:
        return "the file could not be analysed"
    calls: list[cst.Call] = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            func = node.func
            name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
            if name.startswith("memory_efficient_attention"):
                calls.append(node)

    module.visit(_Calls())
    rule = XformersMemoryEfficientAttention()
    for call in calls:
        func = call.func
        name = func.attr.value if isinstance(func, cst.Attribute) else func.value
        if name in REPORTED:
            return f"{name} is not rewritten"
        try:
            outcome = rule.check_call(call, ctx)
        except Refuse as refusal:
            return refusal.reason
        if not isinstance(outcome, Rewrite):
            return "not rewritten"
    return None
