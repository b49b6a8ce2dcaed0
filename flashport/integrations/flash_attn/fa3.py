"""Drop-ins for FlashAttention-3 (``flash_attn_interface``, Hopper build) on :func:`flashport.torch.attention`.

``from flashport.integrations.flash_attn3_compat import flash_attn_func`` (the import path that
re-exports this module) replaces
``from flash_attn_interface import flash_attn_func``. Signatures and return types follow FA3 after
2025-07-11: ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs=True`` (before that date FA3
always returned ``(out, lse)``; code written against it must pass ``return_attn_probs=True``). The
semantics are FA2's: ``[B, S, H, D]``, ``1/sqrt(D)`` default scale, bottom-right causal and
inclusive window (-1 = unbounded), softcap 0.0 = off, contiguous GQA; lse is float32 ``[B, H, Sq]``
(``[H, total_q]`` for varlen), natural log, and **-inf** for a row that sees no key, as FA3's
kernel writes it (``hopper/softmax.h`` ``finalize`` and ``epilogue_fwd.hpp`` ``store_zero``; FA2
writes +inf there). Only when there is no key row at all (``total_k == 0``) does FA3 skip the kernel
and fill lse with +inf (``mha_fwd``); the drop-ins do the same.
FA3 has no dropout. Tuning arguments (``num_splits``, ``pack_gqa``, ``deterministic``,
``sm_margin``, ``scheduler_metadata``) are ignored; FP8 descales, ``attention_chunk`` and
``seqused_*`` raise ``NotImplementedError``, and so does ``qv`` in ``flash_attn_func`` /
``flash_attn_varlen_func``.

:func:`flash_attn_with_kvcache` is FA3's KV-cache call with its full behaviour
(:mod:`.fa3_kvcache`): the new rows are written **in place** into the
caches (rotated, at ``cache_seqlens``, through ``cache_batch_idx`` or the pages of ``page_table``),
varlen decode (``cu_seqlens_q``, ``cu_seqlens_k_new``), ``rotary_seqlens``, ``cache_leftpad`` and
the MLA ``qv``. It returns ``out``, or with ``return_softmax_lse=True`` FA3's ``(out, softmax_lse,
*rest)``: ``rest`` is FA3's two split-KV accumulators, empty tensors here as in FA3 when it does
not split.
"""

from __future__ import annotations

from flashport.integrations.flash_attn import fa3_kvcache as impl
from flashport.integrations.flash_attn.core import flash_attn_window, varlen_core, with_signature

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
    "sgl_flash_attn_varlen_func",
    "sgl_flash_attn_with_kvcache",
]


def _fa3_lse(lse, no_keys):
    """FA3's lse from the contract's: -inf for a row that sees no key (the contract's value too), but
    +inf on every row when ``no_keys`` (FA3's ``mha_fwd`` skips the kernel when ``total_k == 0`` and
    fills lse with +inf)."""
    return lse.new_full(lse.shape, float("inf")) if no_keys else lse


def _unsupported(**given):
    """Raise NotImplementedError naming the first FA3-only feature that was passed."""
    for name, value in given.items():
        off = value is None or value is False or (isinstance(value, (int, float)) and value == 0)
        if not off:
            raise NotImplementedError(f"FlashAttention-3 {name}= is not supported by flashport's drop-in")


# FA3's parameters after the tensors (and cu_seqlens / max_seqlen) of flash_attn_func and
# flash_attn_varlen_func, and their defaults.
_TAIL = (
    "softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk softcap "
    "num_splits pack_gqa deterministic sm_margin return_attn_probs"
)
_DEFAULTS = {
    "seqused_q": None,
    "seqused_k": None,
    "softmax_scale": None,
    "causal": False,
    "qv": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "window_size": (-1, -1),
    "attention_chunk": 0,
    "softcap": 0.0,
    "num_splits": 1,
    "pack_gqa": None,
    "deterministic": False,
    "sm_margin": 0,
    "return_attn_probs": False,
}
# sgl-kernel's build of flash_attn_interface (and the vendor builds that copy it): its own defaults
_SGL_DEFAULTS = {
    **_DEFAULTS,
    "max_seqlen_q": None,
    "max_seqlen_k": None,
    "page_table": None,
    "only_qv": False,
    "return_softmax_lse": False,
    "sinks": None,
    "out": None,
}
_FP8_AND_CHUNKS = ("q_descale", "k_descale", "v_descale", "attention_chunk")


def _contract(options, *unsupported):
    """The contract's scale and band keywords from FA3's ``options``, after refusing the features
    ``unsupported`` and FP8 / chunked attention; the tuning arguments are ignored."""
    _unsupported(**{name: options[name] for name in (*unsupported, *_FP8_AND_CHUNKS)})
    window = flash_attn_window(options["window_size"])
    return dict(
        scale=options["softmax_scale"],
        causal=options["causal"],
        window=window,
        softcap=options["softcap"] or None,
    )


@with_signature(f"q k v | {_TAIL}", _DEFAULTS)
def flash_attn_func(q, k, v, **options):
    """FA3 ``flash_attn_func``: q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> out, or ``(out, lse)``."""
    import flashport.torch

    contract, return_lse = _contract(options, "qv"), bool(options["return_attn_probs"])
    result = flashport.torch.attention(
        q, k, v, **contract, align="bottom_right", layout="BSHD", return_lse=return_lse
    )
    return (result[0], _fa3_lse(result[1], k.shape[:2].numel() == 0)) if return_lse else result


@with_signature(
    f"q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k | seqused_q seqused_k {_TAIL}", _DEFAULTS
)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """FA3 ``flash_attn_varlen_func``: q [total_q, H, D], k/v [total_k, Hk, D] -> out, or ``(out, lse [H, total_q])``."""
    contract = _contract(options, "seqused_q", "seqused_k", "qv")
    return_lse = bool(options["return_attn_probs"])
    result = varlen_core(q, k, v, cu_seqlens_q, cu_seqlens_k, **contract, return_lse=return_lse)
    return (result[0], _fa3_lse(result[1], k.shape[0] == 0)) if return_lse else result


@with_signature(
    "q k v cu_seqlens_q cu_seqlens_k | max_seqlen_q max_seqlen_k seqused_q seqused_k page_table "
    "softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk softcap "
    "num_splits pack_gqa only_qv sm_margin return_softmax_lse sinks out",
    _SGL_DEFAULTS,
)
def sgl_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """sgl-kernel's FA3 ``flash_attn_varlen_func`` (the ``flash_attn_interface`` of sgl-kernel and of
    the vendor builds that copy it): q [total_q, H, D], k/v [total_k, Hk, D] -> ``out``, or with
    ``return_softmax_lse=True`` ``(out, softmax_lse [H, total_q], *rest)`` (``rest``: the two
    split-KV accumulators, empty here as when the kernel does not split). ``page_table``,
    ``seqused_*``, ``qv``, ``only_qv``, ``sinks`` and ``out`` raise NotImplementedError when given."""
    contract = _contract(options, "seqused_q", "seqused_k", "page_table", "qv", "only_qv", "sinks", "out")
    return_lse = bool(options["return_softmax_lse"])
    result = varlen_core(q, k, v, cu_seqlens_q, cu_seqlens_k, **contract, return_lse=return_lse)
    if not return_lse:
        return result
    return impl.returned(result[0], _fa3_lse(result[1], k.shape[0] == 0))


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """FA3 ``flash_attn_with_kvcache`` (module docstring), updating the caches in place.

    Args:
      q: [B, S_q, H, D], or [total_q, H, D] with ``cu_seqlens_q`` [B + 1] and ``max_seqlen_q``.
      k_cache, v_cache: [B_cache, S_cache, Hk, D / Dv], or [num_pages, page, Hk, D / Dv] with
        ``page_table`` [B, max_pages] (int). k, v: optional new rows [B, S_new, Hk, D / Dv], or
        [total_new, Hk, D / Dv] with ``cu_seqlens_k_new``.
      qv: optional [.., H, Dv]: adds ``qv . v`` to the scores (MLA).
      rotary_cos, rotary_sin: optional [seqlen_ro, rotary_dim / 2] (only with ``k``/``v``);
        ``rotary_seqlens``: optional int [B], their start position (default ``cache_seqlens``).
      cache_seqlens: int or int [B]: rows already in the cache (None = the whole cache).
      cache_batch_idx: optional int [B]: cache row (or page-table row) of each sequence.
      cache_leftpad: optional int [B]: first valid row of each sequence.
      softmax_scale, causal, window_size, softcap: as FA2 (bottom-right, -1 = unbounded, 0 = off);
        the default scale is ``(D + Dv) ** -0.5`` with ``qv``, else ``D ** -0.5``.
      rotary_interleaved: pair dims (0, 1), (2, 3)... else GPT-NeoX halves.
      scheduler_metadata, num_splits, pack_gqa, sm_margin: ignored (kernel tuning).
      q_descale, k_descale, v_descale, attention_chunk: FP8 / chunked attention, not supported.
      return_softmax_lse: also return lse [B, H, S_q] ([H, total_q] for varlen; float32, -inf for a
        row that sees no key, +inf everywhere for an empty cache without new rows) and FA3's two
        split-KV accumulators (empty).

    Returns:
      ``out`` [B, S_q, H, Dv] (or [total_q, H, Dv]), or ``(out, softmax_lse, out_accum, lse_accum)``.

    Raises:
      ValueError: ``k`` without ``v``, rotary without new rows, ``cu_seqlens_q`` without
        ``max_seqlen_q``, new rows without ``cache_seqlens`` or that do not fit the cache.
      NotImplementedError: FP8 descales, a non-zero ``attention_chunk``.
    """
    _unsupported(
        **dict(zip(_FP8_AND_CHUNKS, (q_descale, k_descale, v_descale, attention_chunk), strict=True))
    )
    varlen = (cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q)
    impl.check(k, v, (rotary_cos, rotary_sin), *varlen, cache_seqlens)
    cache, lengths = impl.cache_view(k_cache, q, cu_seqlens_q, cache_seqlens, cache_batch_idx, page_table)
    options = dict(
        scale=softmax_scale,
        causal=causal,
        window=flash_attn_window(window_size),
        softcap=softcap or None,
        return_lse=bool(return_softmax_lse),
        rotate_per_row=impl.rotates_per_row(
            causal, window_size, q.shape[1] if cu_seqlens_q is None else int(max_seqlen_q), cache.length
        ),
    )
    out, lse = impl.run(
        q,
        (k_cache, v_cache),
        (k, v),
        qv,
        cache=cache,
        lengths=lengths,
        rotary=None if rotary_cos is None else (rotary_cos, rotary_sin, rotary_interleaved),
        varlen=varlen,
        rotary_seqlens=rotary_seqlens,
        leftpad=cache_leftpad,
        options=options,
    )
    if not return_softmax_lse:
        return out
    return impl.returned(out, _fa3_lse(lse, impl.no_key_rows(k_cache, k)))


_SGL_KVCACHE = (
    "q k_cache v_cache | k v qv rotary_cos rotary_sin cache_seqlens cache_batch_idx cache_leftpad "
    "page_table cu_seqlens_q cu_seqlens_k_new max_seqlen_q rotary_seqlens q_descale k_descale v_descale "
    "softmax_scale causal window_size attention_chunk softcap rotary_interleaved scheduler_metadata "
    "num_splits pack_gqa only_qv sm_margin return_softmax_lse sinks out"
)
_SGL_KVCACHE_DEFAULTS = {
    **_SGL_DEFAULTS,
    **{name: None for name in _SGL_KVCACHE.split() if name not in _SGL_DEFAULTS},
    "attention_chunk": None,
    "rotary_interleaved": True,
    "num_splits": 0,
}


@with_signature(_SGL_KVCACHE, _SGL_KVCACHE_DEFAULTS)
def sgl_flash_attn_with_kvcache(q, k_cache, v_cache, only_qv, return_softmax_lse, sinks, out, **options):
    """sgl-kernel's FA3 ``flash_attn_with_kvcache`` (vendor builds copy it): FA3's
    (:func:`flash_attn_with_kvcache`, the caches updated in place) plus ``sinks``, an ``out`` buffer
    and ``only_qv``. ``sinks`` [H]: one logit per head that joins each row's softmax without a value
    (the row's weights shrink by ``sigmoid(lse - sink)``); with ``return_softmax_lse=True`` it raises
    NotImplementedError (whether that build's lse counts the sink is not recorded), as does
    ``only_qv=True``."""
    import torch

    _unsupported(only_qv=only_qv)
    if sinks is not None and return_softmax_lse:
        raise NotImplementedError(
            "sinks= with return_softmax_lse=True is not supported by flashport's drop-in"
        )
    options["attention_chunk"] = options["attention_chunk"] or 0
    want_lse = bool(return_softmax_lse) or sinks is not None
    result = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=want_lse, **options)
    if sinks is not None:
        attended, lse = result[0], result[1]
        weight = torch.sigmoid(lse.float() - sinks.float()[:, None])  # [.., H, S_q]
        weight = weight.transpose(-1, -2)[..., None]  # [.., S_q, H, 1]: out's layout
        result = (attended.float() * weight).to(attended.dtype)
    if out is not None:
        out.copy_(result[0] if want_lse and sinks is None else result)
        result = (out, *result[1:]) if want_lse and sinks is None else out
    return result


_SCHEDULER_DEFAULTS = {
    "qkv_dtype": None,
    "headdim_v": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k_new": None,
    "cache_leftpad": None,
    "page_size": None,
    "max_seqlen_k_new": 0,
    "causal": False,
    "window_size": (-1, -1),
    "attention_chunk": 0,
    "has_softcap": False,
    "num_splits": 0,
    "pack_gqa": None,
    "sm_margin": 0,
}


@with_signature(
    "batch_size max_seqlen_q max_seqlen_k num_heads_q num_heads_kv headdim cache_seqlens | qkv_dtype "
    "headdim_v cu_seqlens_q cu_seqlens_k_new cache_leftpad page_size max_seqlen_k_new causal window_size "
    "attention_chunk has_softcap num_splits pack_gqa sm_margin",
    _SCHEDULER_DEFAULTS,
)
def get_scheduler_metadata(**launch):
    """FA3's ``get_scheduler_metadata``: the split-KV launch plan its kernels take as
    ``scheduler_metadata=``. Returns None, which FA3's functions read as "plan this call
    yourself" and flashport's drop-ins ignore (they launch no split-KV kernel); the arguments only
    describe the launch. ``qkv_dtype`` defaults to None (FA3: ``torch.bfloat16``), as this module
    imports torch only when a function runs."""
    return None
