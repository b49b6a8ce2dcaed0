"""FPA005 flash-attn-varlen-qkvpacked-func: ``flash_attn_varlen_qkvpacked_func`` -> ``flashport.varlen_attention``.

What it rewrites:
  ``flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
  window_size, softcap, alibi_slopes, deterministic, return_attn_probs)`` from ``flash_attn`` /
  ``flash_attn.flash_attn_interface`` (any alias), and its flash-attn 1.x name
  ``flash_attn_unpadded_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
  causal, return_attn_probs, deterministic)`` from ``flash_attn.flash_attn_interface``.

Semantics mapping:
  ``qkv`` is packed ``[total, 3, H, D]``; it is split once with ``*qkv.unbind(1)`` into THD q, k, v.
  One ``cu_seqlens`` (int32 ``(B+1,)``) serves queries and keys, so it is passed as both
  ``cu_seqlens_q`` and ``cu_seqlens_k`` of ``flashport.varlen_attention`` (per-sequence causal and
  window; with equal lengths bottom-right and top-left coincide, ``align`` is still stated).
  ``max_seqlen`` is dropped (kernel launch size only). Scale, window, softcap as FPA001; the 1.x
  name gets ``align="top_left"`` (1.x causal is top-left, as FPA004).

What it refuses:
  as FPA004 (dropout, ALiBi and splats go to the drop-in as there;
  ``return_attn_probs`` with dropout, unknown arguments), and a ``cu_seqlens``
  expression that is not a plain name/attribute/subscript (it would be evaluated twice).

Example::

    out = flash_attn_varlen_qkvpacked_func(qkv, cu, max_len, 0.0, causal=True)
    # becomes
    out = flashport.varlen_attention(*qkv.unbind(1), cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, align="bottom_right", layout="THD")
"""

from __future__ import annotations

from flashport.rules.base import Refuse, register
from flashport.rules.common import node_context
from flashport.rules.flash_attn import arguments as fa
from flashport.rules.flash_attn.dense_varlen import VarlenRule


@register
class FlashAttnVarlenQKVPackedFunc(VarlenRule):
    """Rewrite flash-attn 2.x ``flash_attn_varlen_qkvpacked_func`` to ``flashport.varlen_attention``."""

    CODE = "FPA005"
    NAME = "flash-attn-varlen-qkvpacked-func"
    FUNCTION = "flash_attn_varlen_qkvpacked_func"
    DROPPED_NOTE = "dropped max_seqlen (kernel launch size only)"

    def split(self, values, ctx):
        """Split the packed tensor once and pass the one ``cu_seqlens`` for both sides."""
        qkv, cu = values
        if not node_context.simple(cu):
            raise Refuse(
                f"cu_seqlens={ctx.code(cu)} would be evaluated twice (queries and keys); bind it to a name first"
            )
        return [fa.unbind(qkv, 1)], cu, cu
