"""FPA006 flash-attn-varlen-kvpacked-func: ``flash_attn_varlen_kvpacked_func`` -> ``flashport.varlen_attention``.

What it rewrites:
  ``flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
  return_attn_probs)`` from ``flash_attn`` / ``flash_attn.flash_attn_interface``, and its
  flash-attn 1.x name ``flash_attn_unpadded_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, return_attn_probs, deterministic)``
  from ``flash_attn.flash_attn_interface``.

Semantics mapping:
  ``q`` is ``[total_q, H, D]``, ``kv`` packed ``[total_k, 2, Hk, D]``; ``kv`` is split once with
  ``*kv.unbind(1)``. Causal and window are bottom-right **per sequence** (offset
  ``len_k[b] - len_q[b]``), which ``flashport.varlen_attention`` reproduces from the two
  ``cu_seqlens``; GQA (Hk divides H, contiguous groups) carries over. ``max_seqlen_*`` are dropped.
  Scale, window, softcap as FPA001. flash-attn 1.x causal is **top-left** per sequence, so the 1.x
  name gets ``align="top_left"``.

What it refuses:
  as FPA004 (dropout, ALiBi and splats go to the drop-in as there): ``return_attn_probs`` with
  dropout, unknown arguments.

Example::

    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, causal=True)
    # becomes
    out = flashport.varlen_attention(q, *kv.unbind(1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, align="bottom_right", layout="THD")
"""

from __future__ import annotations

from flashport.rules.base import register
from flashport.rules.flash_attn.dense_varlen import VarlenRule


@register
class FlashAttnVarlenKVPackedFunc(VarlenRule):
    """Rewrite flash-attn 2.x ``flash_attn_varlen_kvpacked_func`` to ``flashport.varlen_attention``."""

    CODE = "FPA006"
    NAME = "flash-attn-varlen-kvpacked-func"
    FUNCTION = "flash_attn_varlen_kvpacked_func"
