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

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common.binding import required
from flashport.rules.common.calls import build_call, string
from flashport.rules.flash_attn import arguments as fa

LEADING = ("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class FlashAttnVarlenKVPackedFunc(Rule):
    """Rewrite flash-attn 2.x ``flash_attn_varlen_kvpacked_func`` to ``flashport.varlen_attention``."""

    CODE = "FPA006"
    NAME = "flash-attn-varlen-kvpacked-func"
    API = "flash_attn.flash_attn_varlen_kvpacked_func"
    FRAMEWORK = "torch"
    SOURCES = fa.sources("flash_attn_varlen_kvpacked_func") + fa.fa1_sources(
        "flash_attn_unpadded_kvpacked_func"
    )
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.varlen_attention"

    def check_call(self, call, ctx):
        """Split kv once, pass both cu_seqlens, map the rest like FPA001."""
        splat = fa.splat_drop_in(call, ctx)
        if splat is not None:
            return splat
        sig, version = fa.varlen_signature(LEADING, ctx.qualified_name, ctx.options.flash_attn_version)
        bound = sig.bind(call, self.API)
        q, kv, cu_q, cu_k = required(bound, LEADING[:4], self.API)
        drop_in = fa.varlen_drop_in(call, bound, ctx, len(LEADING))
        drop_in = drop_in or fa.probs_drop_in(call, bound, ctx, len(LEADING))
        if drop_in is not None:
            return drop_in
        keywords, notes = fa.map_arguments(bound, ctx, self.API, version, dropout=False)
        keywords = [("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)] + keywords
        notes.append("dropped max_seqlen_q/max_seqlen_k (kernel launch sizes only)")
        node = build_call(self.TARGET, [q, fa.unbind(kv, 1)], keywords + [("layout", string("THD"))], call)
        return Rewrite(node, notes=tuple(notes))
