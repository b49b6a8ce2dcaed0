"""FPA007 flash-attn-with-kvcache: ``flash_attn_with_kvcache`` -> a functional ``kvcache_attention`` or the drop-in.

What it rewrites:
  ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=..., softmax_scale=...,
  causal=..., window_size=..., softcap=..., return_softmax_lse=...)`` from ``flash_attn`` /
  ``flash_attn.flash_attn_interface`` into
  ``flashport.integrations.flash_attn_compat.kvcache_attention(...)``, in two cases:

  * no new ``k``/``v``: a pure read of the cache (nothing is mutated), always safe;
  * new ``k``/``v`` whose in-place cache update is **provably not relied on**: ``k_cache`` and
    ``v_cache`` are plain local names of the enclosing function (assigned there, not parameters,
    not ``global``/``nonlocal``), read nowhere else, and the call is not inside a loop. The
    functional call inserts the rows into a copy and attends over it, so the output is the same.

  Every other call -- new ``k``/``v`` whose in-place update may be relied on (caches that are
  attributes, parameters, aliases, updated in a loop), ``rotary_cos``/``rotary_sin``,
  ``cache_batch_idx``, ``cache_leftpad``, ``block_table``, ``return_softmax_lse`` that is not
  literally false (flash-attn's lse is +inf for a row that sees no key, the contract's -inf), a
  ``*args``/``**kwargs`` splat --
  keeps its arguments and becomes a call of the drop-in
  ``flashport.integrations.flash_attn_compat.flash_attn_with_kvcache``, which has flash-attn's
  signature and full behaviour: it writes the new rows **in place** into the caches (rotated, at
  ``cache_seqlens``, through ``cache_batch_idx`` or the pages of ``block_table``) and attends like
  flash-attn (rotary positions, ``cache_leftpad``, per-sequence bottom-right causal/window).

Semantics mapping:
  layout ``[B, S, H, D]`` kept; keys ``j < cache_seqlens[b] (+ S_new)`` are valid; causal/window are
  bottom-right **per sequence** (offset ``L_b - S_q``), built as a boolean mask; ``softmax_scale`` ->
  ``scale``; ``window_size`` (-1 = unbounded) -> ``window`` (None); ``softcap`` 0.0 -> off;
  ``num_splits`` / ``rotary_interleaved`` are dropped (kernel tuning / unused without rotary).
  Only ``q, k_cache, v_cache, k, v`` may be positional (the rest moved between 2.2 and 2.6).

What it refuses:
  ``alibi_slopes``, only one of ``k``/``v``, new ``k``/``v`` without ``cache_seqlens``, positional
  arguments after ``v`` (their positions changed between releases), unknown arguments.

Example::

    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    # becomes
    out = flashport.integrations.flash_attn_compat.kvcache_attention(q, k_cache, v_cache, cache_seqlens=lens, scale=None, causal=True)
    out = flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=lens, causal=True)
    # becomes (the caches are updated in place, as before)
    out = flashport.integrations.flash_attn_compat.flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=lens, causal=True)
"""

from __future__ import annotations

from flashport.rules.base import register
from flashport.rules.flash_attn import arguments as fa
from flashport.rules.flash_attn.kvcache import MODULE, KVCacheRule

UNSUPPORTED = {
    "rotary_cos": "fused rotary embedding (rotary_cos/rotary_sin) is not part of the attention contract; apply rotary first",
    "rotary_sin": "fused rotary embedding (rotary_cos/rotary_sin) is not part of the attention contract; apply rotary first",
    "cache_batch_idx": "cache_batch_idx (indirect cache rows) has no portable equivalent",
    "cache_leftpad": "cache_leftpad (left-padded caches) has no portable equivalent",
    "block_table": "block_table (paged KV cache) has no portable equivalent",
    "alibi_slopes": "alibi_slopes: flash-attn's symmetric ALiBi bias has no portable equivalent here",
}
# What only the drop-in ``flash_attn_compat.flash_attn_with_kvcache`` (flash-attn's full behaviour,
# in-place update included) can port; the functional ``kvcache_attention`` cannot.
DROP_IN_ONLY = ("rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "block_table")


@register
class FlashAttnWithKVCache(KVCacheRule):
    """Rewrite ``flash_attn_with_kvcache`` to a functional call where the in-place update is not relied on."""

    CODE = "FPA007"
    NAME = "flash-attn-with-kvcache"
    SOURCES = fa.sources("flash_attn_with_kvcache")
    TRIGGERS = (b"flash_attn",)
    UNSUPPORTED = UNSUPPORTED
    DROP_IN_ONLY = DROP_IN_ONLY
    DROPPED = ("num_splits", "rotary_interleaved")
    DROP_IN = MODULE + ".flash_attn_with_kvcache"
    LSE_DROP_IN = (
        "return_softmax_lse=True: flash-attn's lse is +inf for a row that sees no key (an empty cache), "
        "the contract's -inf"
    )

    def splat(self, call, ctx):
        """A ``*args``/``**kwargs`` splat on the FA2 drop-in (bound at run time; see ``_flash_attn``)."""
        return fa.splat_drop_in(call, ctx)
