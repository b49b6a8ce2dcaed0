"""An independent float64 reference of the flashport.attention contract, written from its text.

Plain numpy, materialized, K/V heads repeated explicitly: deliberately nothing like the backends.
Returns (out, lse) in the BHSD layout; out in float64.
"""

from __future__ import annotations

import numpy as np


def reference_attention(q, k, v, *, scale=None, causal=False, window=None, align="bottom_right",
                        softcap=None, bias=None, mask=None, q_segment_ids=None, kv_segment_ids=None,
                        layout="BSHD"):
    """float64 attention following the contract; inputs in ``layout``, outputs (out BHSD/BSHD, lse)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if layout == "BSHD":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    k = np.repeat(k, group, axis=1)  # head h uses kv head h // group
    v = np.repeat(v, group, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64), (b, hq, sq, sk))
    keep = np.ones((b, hq, sq, sk), bool)
    offset = sk - sq if align == "bottom_right" else 0
    i = np.arange(sq)[:, None] + offset
    j = np.arange(sk)[None, :]
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    if mask is not None:
        keep &= np.broadcast_to(np.asarray(mask, bool), keep.shape)
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids)[:, None, :, None]
        ks = np.asarray(kv_segment_ids)[:, None, None, :]
        keep &= qs == ks
    s = np.where(keep, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bhkd->bhqd", p, v) / np.where(l > 0, l, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    if layout == "BSHD":
        out = out.transpose(0, 2, 1, 3)
    return out, lse
