"""FPA012 fa3-flash-attn-with-kvcache: FlashAttention-3 ``flash_attn_with_kvcache`` -> functional ``kvcache_attention`` or the FA3 drop-in.

What it rewrites:
  ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, ...,
  cache_seqlens=..., cache_batch_idx=..., cache_leftpad=..., page_table=..., cu_seqlens_q=...,
  cu_seqlens_k_new=..., max_seqlen_q=..., rotary_seqlens=..., softmax_scale=..., causal=...,
  window_size=..., softcap=..., return_softmax_lse=...)`` from ``flash_attn_interface`` /
  ``flash_attn_3.flash_attn_interface`` / ``hopper.flash_attn_interface``, as FPA007 does for FA2:

  * a pure read of the cache, or new ``k``/``v`` whose in-place update provably is not relied on
    (FPA007's rule), with none of the arguments below: the functional
    ``flashport.integrations.flash_attn_compat.kvcache_attention(...)``;
  * every other call -- an in-place update that may be relied on, ``rotary_cos``/``rotary_sin``,
    ``rotary_seqlens``, ``cache_batch_idx``, ``cache_leftpad``, ``page_table`` (paged cache),
    varlen decode (``cu_seqlens_q``, ``cu_seqlens_k_new``, ``max_seqlen_q``), ``qv`` (MLA),
    ``return_softmax_lse`` that is not literally false (FA3 returns ``(out, softmax_lse, *rest)``,
    the functional form ``(out, lse)``), a ``*args``/``**kwargs`` splat -- keeps its arguments and
    becomes a call of the drop-in ``flashport.integrations.flash_attn3_compat.flash_attn_with_kvcache``,
    which has FA3's signature and full behaviour (the new rows are written **in place** into the
    caches the caller holds).

  The function used as a value (a dispatch table, an alias, ``@functools.wraps(...)``) becomes that
  drop-in too: FA3's cache call returns ``out`` unless ``return_softmax_lse=True`` (unchanged when
  ``flash_attn_func``'s return type changed on 2025-07-11), so the callers out of sight get what
  they got.

  FA3's ``get_scheduler_metadata`` (the launch plan passed as ``scheduler_metadata=``), called or
  as a value, becomes the drop-in of the same signature, which returns None: FA3 reads None as
  "plan each call", and flashport's drop-ins launch no split-KV kernel.

  A call passing ``sinks=``, ``only_qv=`` or ``out=`` (keywords of sgl-kernel's build of
  ``flash_attn_interface`` and its vendor copies, not of FA3's) goes to
  ``flash_attn3_compat.sgl_flash_attn_with_kvcache``, which has that build's signature and folds
  the per-head sink logits into each row's softmax.

Semantics mapping:
  as FPA007 (per-sequence bottom-right causal/window over ``cache_seqlens[b] (+ S_new)`` keys). The drop-in returns FA3's
  ``(out, softmax_lse, *rest)`` (``rest``: FA3's two split-KV accumulators, empty) and follows
  FA3's semantics for what FA2 lacks: ``page_table`` with ``cache_batch_idx`` picks page-table rows,
  varlen decode is bottom-right on each sequence's own query count (lse ``[H, total_q]``),
  ``rotary_seqlens`` is the rotary position of the first new row, and ``qv`` adds ``qv . v`` to the
  scores with the default scale ``(D + Dv) ** -0.5``. ``scheduler_metadata``, ``num_splits``,
  ``pack_gqa``, ``sm_margin`` and (without rotary) ``rotary_interleaved`` are dropped or ignored
  (tuning / rotary only).

What it refuses:
  FP8 ``q_descale``/``k_descale``/``v_descale``, non-zero ``attention_chunk``, only one of
  ``k``/``v``, new ``k``/``v`` without ``cache_seqlens``, positional arguments after ``v`` (FA3
  inserted ``qv`` there), unknown arguments; for sgl-kernel's build, FP8 descales or ``only_qv``
  given by an expression other than a forwarded name.

Example::

    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    # becomes
    out = flashport.integrations.flash_attn_compat.kvcache_attention(q, k_cache, v_cache, cache_seqlens=lens, scale=None, causal=True)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, page_table=table, causal=True)
    # becomes
    out = flashport.integrations.flash_attn3_compat.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, page_table=table, causal=True)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules import apis
from flashport.rules.base import Refuse, Report, Rewrite, register
from flashport.rules.common import values
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import dotted, on_drop_in
from flashport.rules.common.literals import is_none, is_zero, literal_bool
from flashport.rules.flash_attn.fa3_fa4 import fa3_sources
from flashport.rules.flash_attn.kvcache import POSITIONAL, KVCacheRule

DROP_IN_MODULE = "flashport.integrations.flash_attn3_compat"
# Only the drop-in (FA3's full behaviour) implements these; the functional form cannot.
DROP_IN_ONLY = (
    "rotary_cos",
    "rotary_sin",
    "rotary_seqlens",
    "cache_batch_idx",
    "cache_leftpad",
    "page_table",
    "cu_seqlens_q",
    "cu_seqlens_k_new",
    "max_seqlen_q",
    "qv",
)
UNSUPPORTED = {
    name: "FP8 descale factors: flashport has no FP8 attention path"
    for name in ("q_descale", "k_descale", "v_descale")
}


@register
class FA3FlashAttnWithKVCache(KVCacheRule):
    """Rewrite FlashAttention-3 ``flash_attn_with_kvcache`` like FPA007 (FA3 argument names, FA3 drop-in)."""

    CODE = "FPA012"
    NAME = "fa3-flash-attn-with-kvcache"
    SOURCES = fa3_sources("flash_attn_with_kvcache") + fa3_sources("get_scheduler_metadata")
    TRIGGERS = (b"flash_attn_interface",)
    UNSUPPORTED = UNSUPPORTED
    DROP_IN_ONLY = DROP_IN_ONLY
    DROPPED = ("scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "rotary_interleaved")
    DROP_IN_MODULE = DROP_IN_MODULE
    DROP_IN = DROP_IN_MODULE + ".flash_attn_with_kvcache"
    LSE_DROP_IN = "return_softmax_lse=True returns (out, softmax_lse, *rest), not (out, lse)"

    def check_call(self, call, ctx):
        """sgl-kernel's build (a keyword only it has) on its drop-in; the rest as FPA007."""
        if ctx.qualified_name.endswith(SCHEDULER):
            parameters = apis.api(ctx.qualified_name).signatures[-1][1]
            if not any(arg.star for arg in call.args):
                Signature.of(parameters).bind(call, ctx.qualified_name)  # refuses unknown arguments
            return on_drop_in(call, f"{DROP_IN_MODULE}.{SCHEDULER}", SCHEDULER_NOTE)
        if any(arg.keyword is not None and arg.keyword.value in SGL_ONLY for arg in call.args):
            return _sgl_build(call, ctx)
        return super().check_call(call, ctx)

    def check_reference(self, node, ctx):
        """``get_scheduler_metadata`` as a value is its drop-in too (unless probed or compared); the
        cache call's values as every rule's."""
        if not ctx.qualified_name.endswith(SCHEDULER):
            return super().check_reference(node, ctx)
        why = values.probe(ctx)
        if why is not None and not values.inspects_signature(ctx):
            return Report(f"{why}: not a call to port; kept")
        note = f"{values.describe(node, ctx)}: the value is now the drop-in {SCHEDULER} ({SCHEDULER_NOTE})"
        return Rewrite(dotted(f"{DROP_IN_MODULE}.{SCHEDULER}"), imports=(DROP_IN_MODULE,), notes=(note,))

    def splat(self, call, ctx):
        """A ``*args``/``**kwargs`` splat on the FA3 drop-in, which binds it at run time with FA3's
        signature (FA3's cache call returns ``out`` unless ``return_softmax_lse=True``)."""
        if not any(arg.star for arg in call.args):
            return None
        note = (
            "drop-in flash_attn_with_kvcache (FA3's signature; updates the caches in place like FA3): "
            "a *args/**kwargs splat is bound at run time"
        )
        return on_drop_in(call, self.DROP_IN, note)

    def check_extra(self, value, ctx):
        """Refuse a non-zero ``attention_chunk`` (neither form implements chunked attention)."""
        if "attention_chunk" in value and not is_zero(value["attention_chunk"]):
            raise Refuse(
                f"attention_chunk={ctx.code(value['attention_chunk'])}: no portable equivalent (only 0 is accepted)"
            )


SCHEDULER = "get_scheduler_metadata"
SCHEDULER_NOTE = (
    "FA3's launch plan for its split-KV kernels (same signature): the drop-in returns None, which FA3 "
    "reads as 'plan each call' and flashport's cache drop-ins ignore"
)
SGL_API = "sglang.kernels.ops.attention.flash_attention_v3.flash_attn_with_kvcache"
SGL_ONLY = ("sinks", "only_qv", "out")  # keywords of sgl-kernel's build (and its vendor copies), not FA3's


def _sgl_build(call: cst.Call, ctx) -> Rewrite:
    """A call with a keyword only sgl-kernel's build of ``flash_attn_interface`` has (``sinks``,
    ``only_qv``, ``out``) on the drop-in with that build's signature; a ``**kwargs`` splat is bound
    at run time.

    Raises:
      Refuse: positional arguments after ``v``, unknown keywords, FP8 descales or ``only_qv`` given
        by an expression other than a forwarded name (the drop-in raises for those when they are
        set), a non-zero literal ``attention_chunk``.
    """
    if sum(1 for a in call.args if a.keyword is None and not a.star) > len(POSITIONAL):
        raise Refuse("arguments after v must be passed by keyword: their positions changed between builds")
    signature = Signature.of(apis.api(SGL_API).signature_at((0, 5, 23)) or ())
    bound = signature.bind(call.with_changes(args=[a for a in call.args if not a.star]), SGL_API)
    value = {name: arg.value for name, arg in bound.items()}
    for name in ("q_descale", "k_descale", "v_descale", "only_qv"):
        given = value.get(name)
        forwarded = isinstance(given, (cst.Name, cst.Attribute))
        if given is not None and not is_none(given) and literal_bool(given) is not False and not forwarded:
            raise Refuse(f"{name}={ctx.code(given)}: flashport's drop-in has no FP8 or only_qv path")
    chunk = value.get("attention_chunk")
    if chunk is not None and not is_none(chunk) and not is_zero(chunk) and not isinstance(chunk, cst.Name):
        raise Refuse(f"attention_chunk={ctx.code(chunk)}: no portable equivalent (only 0 is accepted)")
    note = (
        "drop-in sgl_flash_attn_with_kvcache: sinks=/only_qv=/out= are parameters of sgl-kernel's (and its "
        "vendor copies') build of flash_attn_interface, not of FA3's; the drop-in has that build's "
        "signature, updates the caches in place and folds the per-head sink logits into each row's "
        "softmax (forwarded FP8 descales, only_qv and sinks with return_softmax_lse=True raise at run time)"
    )
    return on_drop_in(call, f"{DROP_IN_MODULE}.sgl_flash_attn_with_kvcache", note)
