"""An independent float64 reference of the flashport.attention contract, written from its text.

Plain numpy, materialized, K/V heads repeated explicitly: deliberately nothing like the backends.
Outputs are float64; ``out`` in the input layout, ``lse`` [B, Hq, Sq].
"""

from __future__ import annotations

import inspect

import numpy as np


def reference_attention(
    q,
    k,
    v,
    *,
    scale=None,
    causal=False,
    window=None,
    align="bottom_right",
    softcap=None,
    bias=None,
    mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    layout="BSHD",
    dropout_rate=0.0,
    dropout_seed=None,
    score_mod=None,
    mask_mod=None,
):
    """float64 attention following the contract; inputs in ``layout``, outputs (out BHSD/BSHD, lse).

    ``score_mod(s, b, h, i, j)`` / ``mask_mod(b, h, i, j)`` are numpy functions of the whole score
    matrix ``s`` [B, Hq, Sq, Sk] and broadcasting index grids (b [B,1,1,1], h [1,Hq,1,1], i [1,1,Sq,1],
    j [1,1,1,Sk]); the score_mod applies after softcap and bias, the mask_mod is and-ed in.

    ``dropout_seed`` is the pair of uint32 seed words (``jax.random.key(s)`` has ``(s >> 32, s &
    0xFFFFFFFF)``); the keep-mask is :func:`dropout_keep`, written from the contract's definition.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if layout == "BSHD":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    _b, hq, _sq, d = q.shape
    group = hq // k.shape[1]
    k = np.repeat(k, group, axis=1)  # head h uses kv head h // group
    v = np.repeat(v, group, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64), s.shape)
    if score_mod is not None:
        s = _score_mod(score_mod, s)
    keep = _visible(q.shape, k.shape, causal, window, align, mask, q_segment_ids, kv_segment_ids)
    if mask_mod is not None:
        keep = keep & np.broadcast_to(mask_mod(*_grids(s.shape)), keep.shape)
    s = np.where(keep, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    if dropout_rate:
        p = p * dropout_keep(dropout_seed, dropout_rate, p.shape) / (1.0 - dropout_rate)
    out = np.einsum("bhqk,bhkd->bhqd", p, v) / np.where(l > 0, l, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    if layout == "BSHD":
        out = out.transpose(0, 2, 1, 3)
    return out, lse


def reference_attention_vjp(q, k, v, d_out, *, d_lse=None, **options):
    """See :func:`_reference_backward`."""
    return _reference_backward(q, k, v, d_out, d_lse=d_lse, **options)[:4]


def _reference_backward(q, k, v, d_out, *, d_lse=None, **options):
    """float64 gradients (dq, dk, dv, dbias_full) of ``sum(out * d_out)`` (plus ``sum(lse * d_lse)``
    when ``d_lse`` [B, Hq, Sq] is given), derived by hand; ``options`` as :func:`reference_attention`.
    With a ``score_mod`` its derivative is a float64 central difference; :func:`reference_mod_vjp`
    also returns the gradient w.r.t. the score_mod's output.

    The textbook attention backward (dP = dO·Vᵀ, dS = P∘(dP − rowsum(dO∘O)), chain through softcap
    and scale); rows with no visible key get zero gradients. ``dbias_full`` is [B, Hq, Sq, Sk]; sum
    it over broadcast dims to get a broadcast bias's gradient.
    """
    bound = inspect.signature(reference_attention).bind(q, k, v, **options)
    bound.apply_defaults()
    o = bound.arguments
    scale, softcap, bias, layout = o["scale"], o["softcap"], o["bias"], o["layout"]
    dropout_rate, dropout_seed = o["dropout_rate"], o["dropout_seed"]
    kwargs = {n: x for n, x in o.items() if n not in ("q", "k", "v")}
    kwargs["layout"] = "BHSD"
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    if layout == "BSHD":
        q, k, v, d_out = (x.transpose(0, 2, 1, 3) for x in (q, k, v, d_out))
    out, lse = reference_attention(q, k, v, **kwargs)
    b, hq, _sq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    raw = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
    s = softcap * np.tanh(raw / softcap) if softcap is not None else raw
    if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64), s.shape)
    pre = s
    if o["score_mod"] is not None:
        s = _score_mod(o["score_mod"], pre)
    finite = np.isfinite(lse)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(finite, np.exp(s - np.where(finite, lse[..., None], 0.0)), 0.0)
    names = ("causal", "window", "align", "mask", "q_segment_ids", "kv_segment_ids")
    keep = _visible(q.shape, k.shape, *(o[n] for n in names))
    if o["mask_mod"] is not None:
        keep = keep & np.broadcast_to(o["mask_mod"](*_grids(p.shape)), keep.shape)
    p = np.where(keep, p, 0.0)
    # Dropout: out = (P∘Z/(1-r))·V, so dV and dP carry Z/(1-r); delta = rowsum(dO∘O) still holds.
    drop = dropout_keep(dropout_seed, dropout_rate, p.shape) / (1.0 - dropout_rate) if dropout_rate else 1.0
    dv = np.einsum("bhqk,bhqd->bhkd", p * drop, d_out)
    dp = np.einsum("bhqd,bhkd->bhqk", d_out, vr) * drop
    delta = np.sum(d_out * out, axis=-1, keepdims=True)
    if d_lse is not None:  # d lse / d logits = P: the lse cotangent shifts delta
        delta = delta - np.where(finite, np.asarray(d_lse, np.float64)[..., None], 0.0)
    ds = p * (dp - delta)  # gradient w.r.t. the final (post-softcap, post-bias, post-mod) logits
    d_scores = ds.copy()
    if o["score_mod"] is not None:  # d mod / d score by a float64 central difference
        eps = 1e-5
        slope = (_score_mod(o["score_mod"], pre + eps) - _score_mod(o["score_mod"], pre - eps)) / (2 * eps)
        ds = np.where(keep, ds * slope, 0.0)
    dbias = ds.copy()
    if softcap is not None:
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    ds = ds * scale
    dq = np.einsum("bhqk,bhkd->bhqd", ds, kr)
    dk = np.einsum("bhqk,bhqd->bhkd", ds, q)
    dk = dk.reshape(b, hkv, group, *dk.shape[2:]).sum(axis=2)
    dv = dv.reshape(b, hkv, group, *dv.shape[2:]).sum(axis=2)
    if layout == "BSHD":
        dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    return dq, dk, dv, dbias, d_scores


def reference_mod_vjp(q, k, v, d_out, *, d_lse=None, **options):
    """:func:`reference_attention_vjp`'s ``(dq, dk, dv, dbias_full)`` plus ``d_scores`` [B, Hq, Sq,
    Sk]: the gradient w.r.t. the score_mod's output, from which a test sums the gradient of an array
    the score_mod reads (d slope[h] = sum over (b, i, j) of d_scores * d mod / d slope[h])."""
    return _reference_backward(q, k, v, d_out, d_lse=d_lse, **options)


def dropout_keep(seed, rate, shape):
    """The contract's dropout keep-mask [B, Hq, Sq, Sk] (bool), from its written definition.

    uint32 arithmetic is done in Python-int-safe uint64 numpy with explicit wrap-around.
    """
    m32 = np.uint64(0xFFFFFFFF)

    def u32(x):
        return np.asarray(x, np.uint64) & m32

    def mul(x, c):
        return (u32(x) * np.uint64(c)) & m32

    def fmix(x):
        x = u32(x)
        x ^= x >> np.uint64(16)
        x = mul(x, 0x85EBCA6B)
        x ^= x >> np.uint64(13)
        x = mul(x, 0xC2B2AE35)
        return x ^ (x >> np.uint64(16))

    b, h, sq, sk = shape
    k0, k1 = (int(w) for w in seed)
    bb = np.arange(b, dtype=np.uint64)[:, None, None, None]
    hh = np.arange(h, dtype=np.uint64)[None, :, None, None]
    ii = np.arange(sq, dtype=np.uint64)[None, None, :, None]
    jj = np.arange(sk, dtype=np.uint64)[None, None, None, :]
    t_b = fmix(np.uint64(k0) + mul(bb + np.uint64(1), 0x9E3779B9))
    t_bh = fmix(t_b ^ u32(np.uint64(k1) + mul(hh + np.uint64(1), 0x7F4A7C15)))
    row = fmix(t_bh + mul(ii + np.uint64(1), 0x9E3779B9))
    bits = fmix(row ^ mul(jj + np.uint64(1), 0x27D4EB2F))
    cut = min(int(np.floor(rate * 2.0**32)), 0xFFFFFFFF)
    return bits >= np.uint64(cut)


def _visible(q_shape, k_shape, causal, window, align, mask, q_segment_ids, kv_segment_ids):
    b, hq, sq, _ = q_shape
    sk = k_shape[2]
    keep = np.ones((b, hq, sq, sk), bool)
    offset = sk - sq if align == "bottom_right" else 0
    i = np.arange(sq)[:, None] + offset
    j = np.arange(sk)[None, :]
    if causal:
        keep &= j <= i
    if window is not None:
        if window[0] is not None:
            keep &= j >= i - window[0]
        if window[1] is not None:
            keep &= j <= i + window[1]
    if mask is not None:
        keep &= np.broadcast_to(np.asarray(mask, bool), keep.shape)
    if q_segment_ids is not None:
        keep &= np.asarray(q_segment_ids)[:, None, :, None] == np.asarray(kv_segment_ids)[:, None, None, :]
    return keep


def _grids(shape):
    """Broadcasting index grids (b, h, i, j) of a [B, H, Sq, Sk] score matrix."""
    return tuple(np.arange(n).reshape([n if a == d else 1 for a in range(4)]) for d, n in enumerate(shape))


def _score_mod(score_mod, s):
    return np.broadcast_to(np.asarray(score_mod(s, *_grids(s.shape)), np.float64), s.shape)


def reduce_to_shape(full, shape):
    """Sum a [B, H, Sq, Sk] gradient over the dims a broadcast bias of ``shape`` was expanded along."""
    shape = (1,) * (full.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, (f, s) in enumerate(zip(full.shape, shape, strict=True)) if s == 1 and f != 1)
    return np.sum(full, axis=axes, keepdims=True).reshape(shape)
