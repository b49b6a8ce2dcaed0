"""Drop-in replacements for flash-attn 1.x/2.x's public functions, on :func:`flashport.torch.attention`.

``from flashport.integrations.flash_attn_compat import flash_attn_func`` (the import path that
re-exports this module, :mod:`.kvcache`, :mod:`.bert_padding` and :mod:`.private`) works where
``from flash_attn import flash_attn_func`` did, for code the codemod cannot rewrite call by call
(functions used as values, aliases, dispatch tables). Signatures follow flash-attn 2.8.3:

* :func:`flash_attn_func`, :func:`flash_attn_qkvpacked_func`, :func:`flash_attn_kvpacked_func`
  ([B, S, H, D]; causal/window bottom-right, ``window_size`` -1 = unbounded, ``softcap`` 0 = off,
  contiguous GQA, ALiBi as flash-attn's kernel adds it, ``dropout_p`` passed on as the contract's
  ``dropout_p`` -- same scaling, torch's default generator);
* :func:`flash_attn_varlen_func` and its packed variants ([total, H, D] with ``cu_seqlens``;
  per-sequence alignment; paged keys through ``block_table``), and the flash-attn 1.x names
  ``flash_attn_unpadded_*`` (1.x argument order, **top-left** causal).

FlashAttention-3 (``flash_attn_interface``) and -4 (``flash_attn.cute``) have their own drop-ins,
:mod:`.fa3` and :mod:`.fa4` (different signatures and return types).

``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` with ``S_dmask`` flash-attn's
empty tensor when ``dropout_p`` is 0 (flash-attn fills it only with dropout) and None otherwise (the
dropout-encoded probabilities, "for testing only", are not produced). ``deterministic`` and
``num_splits`` are accepted and ignored (backward determinism / kernel tuning). An lse row that sees
no key is +inf, as flash-attn's.

:func:`kvcache_attention` is the functional form the codemod's FPA007 rewrites use:
``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=..., causal=...)`` (flash-attn
2.2+) writes the new keys/values into the caches **in place** at rows ``cache_seqlens[b] ..
cache_seqlens[b] + S_new`` and attends over the first ``cache_seqlens[b] + S_new`` keys of sequence
``b``, with causal/window aligned **bottom-right per sequence** (query ``i`` sees key ``j`` when
``j <= i + L_b - S_q`` for ``L_b`` the sequence's key count). :func:`kvcache_attention` computes the
same output without mutating anything: the new rows go into a copy of each cache (the copy is
returned with ``return_cache=True``), and the per-sequence lengths and alignment become a boolean
mask.
"""

from __future__ import annotations

from flashport.integrations.flash_attn.core import (
    alibi_bias,
    cache_lengths,
    dropout_keywords,
    flash_attn_window,
    kvcache_mask,
    lse_like_flash_attn,
    paged_rows,
    varlen_core,
    with_signature,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_unpadded_func",
    "flash_attn_unpadded_kvpacked_func",
    "flash_attn_unpadded_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "kvcache_attention",
]


def kvcache_attention(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens=None,
    scale=None,
    causal=False,
    window=None,
    softcap=None,
    return_lse=False,
    return_cache=False,
    backend="auto",
):
    """flash-attn ``flash_attn_with_kvcache`` semantics without in-place updates.

    Args:
      q: [B, S_q, H, D]. k_cache, v_cache: [B, S_cache, Hk, D] (Hk divides H).
      k, v: optional new rows [B, S_new, Hk, D], inserted at ``cache_seqlens[b]`` into a copy.
      cache_seqlens: int or int tensor [B]: keys already in the cache (None = the whole cache;
        then ``k``/``v`` must be None).
      scale, softcap: as :func:`flashport.torch.attention` (None = 1/sqrt(D) / off).
      causal, window: bottom-right per sequence (flash-attn >= 2.1).
      return_lse: also return the float32 log-sum-exp [B, H, S_q].
      return_cache: also return the updated ``(k_cache, v_cache)`` copies.
      backend: passed to :func:`flashport.torch.attention`.

    Returns:
      ``out`` [B, S_q, H, D]; with ``return_lse`` ``(out, lse)``; with ``return_cache`` the caches are
      appended: ``(out, k_cache, v_cache)`` or ``(out, lse, k_cache, v_cache)``.

    Raises:
      ValueError: ``k`` without ``v`` (or the reverse), new rows without ``cache_seqlens``, or new
        rows that do not fit in the cache.
    """
    import flashport.torch

    if (k is None) != (v is None):
        raise ValueError("kvcache_attention: pass both k and v, or neither")
    if cache_seqlens is None and k is not None:
        raise ValueError("kvcache_attention: new k/v rows need cache_seqlens (where to insert them)")
    s_cache = k_cache.shape[1]
    lengths = cache_lengths(cache_seqlens, k_cache.shape[0], s_cache, q.device)
    if k is not None:
        k_cache, v_cache, lengths = _insert_copy(k_cache, v_cache, k, v, lengths)
    mask = kvcache_mask(lengths, q.shape[1], s_cache, causal=causal, window=window)
    options = dict(
        scale=scale, softcap=softcap, mask=mask, layout="BSHD", backend=backend, return_lse=return_lse
    )
    result = flashport.torch.attention(q, k_cache, v_cache, **options)
    result = result if isinstance(result, tuple) else (result,)
    if return_cache:
        result = result + (k_cache, v_cache)
    return result[0] if len(result) == 1 else result


def _insert_copy(k_cache, v_cache, k, v, lengths):
    """Copies of the caches with the new rows ``k``/``v`` [B, S_new, Hk, D] at rows ``lengths[b] ..``.

    Returns ``(k_cache, v_cache, lengths + S_new)``.

    Raises:
      ValueError when the new rows do not fit in the cache.
    """
    import torch

    s_new, s_cache = k.shape[1], k_cache.shape[1]
    if s_new and int(lengths.max()) + s_new > s_cache:
        raise ValueError(
            f"kvcache_attention: cache_seqlens + S_new = {int(lengths.max()) + s_new} exceeds the cache length {s_cache}"
        )
    rows = (lengths[:, None] + torch.arange(s_new, device=lengths.device)[None, :]).clamp(max=s_cache - 1)
    index = rows[:, :, None, None]
    k_cache = k_cache.scatter(1, index.expand(-1, -1, *k.shape[2:]), k)
    v_cache = v_cache.scatter(1, index.expand(-1, -1, *v.shape[2:]), v)
    return k_cache, v_cache, lengths + s_new


# ----------------------------------------------------------------------------------- shared pieces

# flash-attn 2.8.3's parameters after the tensors (and cu_seqlens / max_seqlen), and their defaults.
_TAIL = "dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic return_attn_probs"
_VARLEN = "cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k"
_FA1_TAIL = "softmax_scale causal return_attn_probs deterministic"  # after a required dropout_p
_DEFAULTS = {
    "dropout_p": 0.0,
    "softmax_scale": None,
    "causal": False,
    "window_size": (-1, -1),
    "softcap": 0.0,
    "alibi_slopes": None,
    "deterministic": False,
    "return_attn_probs": False,
    "block_table": None,
}
# What flash-attn 1.x had not: its varlen calls are FA2's without window, softcap or ALiBi, top-left.
_FA1 = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, align="top_left")


def _contract(softmax_scale, causal, window_size, softcap, **ignored):
    """flash-attn's scale and band options as the contract's keywords. ``ignored``: ``deterministic``
    and ``max_seqlen_*`` (backward determinism and kernel launch sizes)."""
    return dict(
        scale=softmax_scale, causal=causal, window=flash_attn_window(window_size), softcap=softcap or None
    )


def _dense(q, k, v, *, dropout_p, alibi_slopes, return_attn_probs, **options):
    """The BSHD functions' common body."""
    import flashport.torch

    contract = _contract(**options)
    causal = contract["causal"]
    bias = (
        None if alibi_slopes is None else alibi_bias(alibi_slopes, q.shape[1], k.shape[1], causal, q.device)
    )
    result = flashport.torch.attention(
        q,
        k,
        v,
        **contract,
        align="bottom_right",
        bias=bias,
        layout="BSHD",
        return_lse=bool(return_attn_probs),
        **dropout_keywords(dropout_p),
    )
    if return_attn_probs:
        return result[0], lse_like_flash_attn(result[1]), _s_dmask(q, dropout_p)
    return result


def _s_dmask(q, dropout_p):
    """flash-attn's third value with ``return_attn_probs=True``: an empty tensor without dropout (its
    kernel fills it only when ``dropout_p > 0``), else None (the dropout-encoded probabilities, "for
    testing only", are not produced)."""
    return q.new_empty(0) if not dropout_p else None


# ----------------------------------------------------------------------------------- dense [B, S, H, D]
# Each public function states flash-attn's signature once (``with_signature``) and receives the
# shared options by name.


@with_signature(f"q k v | {_TAIL}", _DEFAULTS)
def flash_attn_func(q, k, v, **options):
    """flash-attn 2.x ``flash_attn_func``: q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> [B, Sq, H, D].

    With ``return_attn_probs=True`` returns ``(out, softmax_lse [B, H, Sq], S_dmask)`` (module docstring).
    """
    return _dense(q, k, v, **options)


@with_signature(f"qkv | {_TAIL}", _DEFAULTS)
def flash_attn_qkvpacked_func(qkv, **options):
    """flash-attn 2.x ``flash_attn_qkvpacked_func``: qkv [B, S, 3, H, D] -> [B, S, H, D]."""
    return _dense(*qkv.unbind(2), **options)


@with_signature(f"q kv | {_TAIL}", _DEFAULTS)
def flash_attn_kvpacked_func(q, kv, **options):
    """flash-attn 2.x ``flash_attn_kvpacked_func``: q [B, Sq, H, D], kv [B, Sk, 2, Hk, D] -> [B, Sq, H, D]."""
    return _dense(q, *kv.unbind(2), **options)


# ----------------------------------------------------------------------------------- varlen [total, H, D]


def _varlen_alibi(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, *, block_table, return_lse, **options):
    """:func:`varlen_core` with flash-attn's ALiBi (``alibi_slopes`` [H] or [B, H]): one dense call
    per sequence with its own bias (:func:`.core.alibi_bias` over that sequence's S_q, S_k), so memory
    stays O(sum of S_q * S_k), never total_q x total_k. Rows past ``cu_seqlens_q[-1]`` are 0 (lse -inf)."""
    import torch

    import flashport.torch

    if block_table is not None:
        k, v = paged_rows(k, block_table, cu_seqlens_k), paged_rows(v, block_table, cu_seqlens_k)
    cu_q, cu_k = (c.tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    out = q.new_zeros(*q.shape[:2], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    causal = options.pop("causal")
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        slopes = alibi_slopes[b] if alibi_slopes.ndim == 2 else alibi_slopes
        bias = alibi_bias(slopes, rows.stop - rows.start, keys.stop - keys.start, causal, q.device)
        result = flashport.torch.attention(
            q[None, rows],
            k[None, keys],
            v[None, keys],
            causal=causal,
            bias=bias,
            layout="BSHD",
            return_lse=return_lse,
            **{name: value for name, value in options.items() if name != "dropout_p"},
            **dropout_keywords(options["dropout_p"]),
        )
        out[rows] = (result[0] if return_lse else result)[0]
        if return_lse:
            lse[:, rows] = result[1][0]
    return (out, lse) if return_lse else out


def _varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    dropout_p,
    alibi_slopes,
    return_attn_probs,
    block_table=None,
    align="bottom_right",
    **options,
):
    """The flash-attn 1/2 varlen functions' common body (flash-attn's lse convention)."""
    options = dict(
        **_contract(**options),
        align=align,
        dropout_p=dropout_p,
        return_lse=bool(return_attn_probs),
        block_table=block_table,
    )
    if alibi_slopes is not None:
        if align != "bottom_right":
            raise NotImplementedError("flash_attn_unpadded_*: alibi_slopes did not exist in flash-attn 1.x")
        result = _varlen_alibi(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, **options)
    else:
        result = varlen_core(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    if return_attn_probs:
        return result[0], lse_like_flash_attn(result[1]), _s_dmask(q, dropout_p)
    return result


@with_signature(f"q k v {_VARLEN} | {_TAIL} block_table", _DEFAULTS)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """flash-attn 2.x ``flash_attn_varlen_func``: q [total_q, H, D], k/v [total_k, Hk, D] (or paged
    [num_blocks, page, Hk, D] with ``block_table`` [B, max_blocks]) -> [total_q, H, D]; lse [H, total_q].
    ``max_seqlen_*`` are ignored (kernel launch sizes)."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)


@with_signature(f"qkv cu_seqlens max_seqlen | {_TAIL}", _DEFAULTS)
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **options):
    """flash-attn 2.x ``flash_attn_varlen_qkvpacked_func``: qkv [total, 3, H, D] -> [total, H, D]."""
    return _varlen(*qkv.unbind(1), cu_seqlens, cu_seqlens, **options)


@with_signature(f"q kv {_VARLEN} | {_TAIL}", _DEFAULTS)
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, **options):
    """flash-attn 2.x ``flash_attn_varlen_kvpacked_func``: q [total_q, H, D], kv [total_k, 2, Hk, D]."""
    return _varlen(q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k, **options)


@with_signature(f"q k v {_VARLEN} dropout_p | {_FA1_TAIL}", _DEFAULTS)
def flash_attn_unpadded_func(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """flash-attn 1.x ``flash_attn_unpadded_func`` (``dropout_p`` required; causal **top-left**)."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options, **_FA1)


@with_signature(f"qkv cu_seqlens max_seqlen dropout_p | {_FA1_TAIL}", _DEFAULTS)
def flash_attn_unpadded_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **options):
    """flash-attn 1.x ``flash_attn_unpadded_qkvpacked_func``: qkv [total, 3, H, D] (causal top-left)."""
    return _varlen(*qkv.unbind(1), cu_seqlens, cu_seqlens, **options, **_FA1)


@with_signature(f"q kv {_VARLEN} dropout_p | {_FA1_TAIL}", _DEFAULTS)
def flash_attn_unpadded_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, **options):
    """flash-attn 1.x ``flash_attn_unpadded_kvpacked_func``: kv [total_k, 2, Hk, D] (causal top-left)."""
    return _varlen(q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k, **options, **_FA1)
