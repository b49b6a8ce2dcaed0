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
  their layouts (padding inside blocks, page tables) are not representable.

Example::

    bias = fmha.BlockDiagonalMask.from_seqlens([3, 5]).make_causal()
    # becomes
    bias = flashport.integrations.xformers_compat.BlockDiagonalMask.from_seqlens([3, 5]).make_causal()
"""

from __future__ import annotations

from flashport.rules.base import Refusal, Rewrite, Rule, dotted, register

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
        return Rewrite(call.with_changes(func=dotted(f"{MODULE}.{name}")), imports=(MODULE,))
