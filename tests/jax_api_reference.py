"""Independent float64 numpy emulations of GPU-only JAX attention APIs, written from their documentation.

Used by ``test_rules_jax_catalogue.py`` as "the original call" for APIs that cannot run on CPU
(cuDNN fused attention, flash-attn-jax). Each follows the API's documented semantics (each function's
docstring states them) -- not flashport's contract and not its code.
"""

from __future__ import annotations

import numpy as np


def _softmax_attend(q, k, v, scale, keep, bias=None, empty_rows="zero"):
    """q [B,T,N,H], k/v [B,S,K,H] (N multiple of K, contiguous groups); keep [B|1,N|1,T,S] bool."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    keep = np.broadcast_to(keep, logits.shape)
    logits = np.where(keep, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(logits - top)
    total = weights.sum(-1, keepdims=True)
    weights = weights / np.where(total > 0, total, 1.0)
    return np.einsum("bnts,bsnh->btnh", weights, v)


def _positions(t, s):
    return np.arange(t)[:, None], np.arange(s)[None, :]


class MaskType:
    """Stand-in names for ``fused_attention_stablehlo.MaskType`` members (compared by name)."""

    NO_MASK, PADDING, CAUSAL, PADDING_CAUSAL, ALIBI = (
        "NO_MASK",
        "PADDING",
        "CAUSAL",
        "PADDING_CAUSAL",
        "ALIBI",
    )


def cudnn_dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    q_seqlen=None,
    kv_seqlen=None,
    q_offsets=None,
    kv_offsets=None,
    fp8_params=None,
    *,
    scale=1.0,
    mask_type=MaskType.NO_MASK,
    seed=42,
    dropout_rate=0.0,
    qkv_layout="BTNH",
    sliding_window_length=None,
    use_fp8=False,
    return_residual=False,
):
    """``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``: scale defaults to **1.0**;
    layouts BTNH/BNTH (output in the query's layout); bool mask True = attend; CAUSAL top-left;
    sliding window keeps keys in ``(pos - L, pos]``."""
    name = getattr(mask_type, "name", mask_type)
    assert name in ("NO_MASK", "CAUSAL") and dropout_rate == 0.0 and q_seqlen is None
    if qkv_layout in ("BNTH", "BNSH"):
        query, key, value = (np.swapaxes(np.asarray(x), 1, 2) for x in (query, key, value))
    t, s = query.shape[1], key.shape[1]
    i, j = _positions(t, s)
    keep = np.ones((t, s), bool)
    if name == "CAUSAL":
        keep &= j <= i
    if sliding_window_length is not None:
        keep &= (j > i - sliding_window_length) & (j <= i)
    if mask is not None:
        keep = keep & np.asarray(mask, bool)
    out = _softmax_attend(query, key, value, scale, keep, bias)
    return np.swapaxes(out, 1, 2) if qkv_layout in ("BNTH", "BNSH") else out


def _fa_keep(t, s, is_causal, window_size):
    """flash-attn 2 masks: bottom-right anchored (offset s - t); window side -1 = unbounded."""
    i, j = _positions(t, s)
    i = i + (s - t)
    keep = np.ones((t, s), bool)
    if is_causal:
        keep &= j <= i
    left, right = window_size
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
    """``flash_attn_jax.flash_mha``: [n, l, h, d]; scale None = 1/sqrt(d); FA2 bottom-right masks;
    a row that sees no key returns 0."""
    scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    return _softmax_attend(q, k, v, scale, _fa_keep(q.shape[1], k.shape[1], is_causal, window_size))


def flash_mha_varlen(
    q,
    k,
    v,
    seqlens_q,
    seqlens_k=None,
    *,
    max_seqlen_q=-1,
    max_seqlen_k=-1,
    softmax_scale=None,
    is_causal=False,
    window_size=(-1, -1),
):
    """``flash_attn_jax.flash_mha_varlen``: packed [total, h, d]; ``seqlens_*`` are **cumulative**
    fence-posts (b+1,); each sequence is attended on its own with FA2 semantics."""
    cu_q = np.asarray(seqlens_q)
    cu_k = cu_q if seqlens_k is None else np.asarray(seqlens_k)
    out = np.zeros(q.shape, np.float64)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        piece = flash_mha(
            np.asarray(q)[None, qs],
            np.asarray(k)[None, ks],
            np.asarray(v)[None, ks],
            softmax_scale,
            is_causal,
            window_size,
        )
        out[qs] = piece[0]
    return out
