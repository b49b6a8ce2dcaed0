"""FPA012 fa3-flash-attn-with-kvcache: FlashAttention-3 ``flash_attn_with_kvcache`` -> functional ``kvcache_attention``.

What it rewrites:
  ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, ..., cache_seqlens=...,
  softmax_scale=..., causal=..., window_size=..., softcap=..., return_softmax_lse=...)`` from
  ``flash_attn_interface`` / ``flash_attn_3.flash_attn_interface`` / ``hopper.flash_attn_interface``,
  exactly as FPA007 does for FA2: cache reads always, new ``k``/``v`` only where the in-place cache
  update provably is not relied on.

Semantics mapping:
  as FPA007 (per-sequence bottom-right causal/window over ``cache_seqlens[b] (+ S_new)`` keys;
  ``return_softmax_lse=True`` -> ``(out, lse)``). ``scheduler_metadata``, ``num_splits``,
  ``pack_gqa``, ``sm_margin`` and ``rotary_interleaved`` are dropped (tuning / rotary only).

What it refuses:
  everything FPA007 ports to its FA2 drop-in instead (in-place update that may be relied on, rotary,
  ``cache_batch_idx``, ``cache_leftpad``, non-literal ``return_softmax_lse``: FA3's signature
  differs, so there is no drop-in here), everything FPA007 refuses, plus FA3's ``page_table`` (paged cache), ``qv``, FP8 descales,
  ``cu_seqlens_q`` / ``cu_seqlens_k_new`` / ``max_seqlen_q`` / ``rotary_seqlens`` (varlen decode),
  non-zero ``attention_chunk``, and ``*args``/``**kwargs`` splats and values (there is no FA3 cache
  drop-in to bind them at run time).

Example::

    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    # becomes
    out = flashport.integrations.flash_attn_compat.kvcache_attention(q, k_cache, v_cache, cache_seqlens=lens, scale=None, causal=True)
"""

from __future__ import annotations

from flashport.rules._fa3_fa4_common import fa3_sources
from flashport.rules.base import Refuse, is_zero, register
from flashport.rules.fpa007_flash_attn_with_kvcache import UNSUPPORTED, FlashAttnWithKVCache

FA3_UNSUPPORTED = {
    **{k: v for k, v in UNSUPPORTED.items() if k not in ("block_table", "alibi_slopes")},
    "page_table": "page_table (paged KV cache) has no portable equivalent",
    "qv": "qv (extra query projection for MLA) has no portable equivalent",
    "cu_seqlens_q": "varlen decode (cu_seqlens_q) is not supported by the functional cache rewrite",
    "cu_seqlens_k_new": "varlen decode (cu_seqlens_k_new) is not supported by the functional cache rewrite",
    "max_seqlen_q": "varlen decode (max_seqlen_q) is not supported by the functional cache rewrite",
    "rotary_seqlens": "fused rotary embedding (rotary_seqlens) is not part of the attention contract",
    **{
        name: "FP8 descale factors: flashport.attention has no FP8 path"
        for name in ("q_descale", "k_descale", "v_descale")
    },
}


@register
class FA3FlashAttnWithKVCache(FlashAttnWithKVCache):
    """Rewrite FlashAttention-3 ``flash_attn_with_kvcache`` like FPA007 (FA3 argument names)."""

    CODE = "FPA012"
    NAME = "fa3-flash-attn-with-kvcache"
    API = "flash_attn_interface.flash_attn_with_kvcache"
    SOURCES = fa3_sources("flash_attn_with_kvcache")
    TRIGGERS = (b"flash_attn_interface",)
    GPU_MODULES = ("flash_attn_interface", "flash_attn_3", "hopper")
    KEYWORDS = (
        "qv",
        "rotary_cos",
        "rotary_sin",
        "cache_seqlens",
        "cache_batch_idx",
        "cache_leftpad",
        "page_table",
        "cu_seqlens_q",
        "cu_seqlens_k_new",
        "max_seqlen_q",
        "rotary_seqlens",
        "q_descale",
        "k_descale",
        "v_descale",
        "softmax_scale",
        "causal",
        "window_size",
        "attention_chunk",
        "softcap",
        "rotary_interleaved",
        "scheduler_metadata",
        "num_splits",
        "pack_gqa",
        "sm_margin",
        "return_softmax_lse",
    )
    UNSUPPORTED = FA3_UNSUPPORTED
    DROPPED = ("scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "rotary_interleaved")
    DROP_IN = None  # FA3's signature differs from the FA2 drop-in's

    def check_extra(self, value, ctx):
        """Refuse a non-zero ``attention_chunk``."""
        if "attention_chunk" in value and not is_zero(value["attention_chunk"]):
            raise Refuse(
                f"attention_chunk={ctx.code(value['attention_chunk'])}: no portable equivalent (only 0 is accepted)"
            )
