"""Independent float64 references of the GPU APIs' *documented* semantics (not of flashport's contract).

Written from the APIs' own documentation and source (flash-attn 2.8.3, torch SDPA, xformers), one query row at a time with explicit index
sets, in torch float64 so autograd gives reference gradients. Used by the end-to-end example tests
and the runtime tests of the rewrite targets.

* :func:`flash_attn_ref` -- flash-attn 2.x ``flash_attn_func``: ``[B, S, H, D]``, causal and window
  bottom-right (offset ``Sk - Sq``), window ``(l, r)`` inclusive with -1 = unbounded, contiguous GQA
  (q head ``h`` uses kv head ``h // (Hq // Hk)``), softcap ``c * tanh(scale * s / c)``, rows with no
  key -> 0.
* :func:`flash_attn_varlen_ref` -- the same per sequence of ``cu_seqlens``.
* :func:`flash_attn_kvcache_ref` -- ``flash_attn_with_kvcache``: in-place insert, then per sequence
  over its first ``cache_seqlens[b] + S_new`` keys.
* :func:`sdpa_ref` -- torch SDPA: ``[B, H, S, D]``, ``is_causal`` top-left, bool mask True = attend,
  float mask added, rows with no key -> 0 (torch >= 2.5).
* :func:`xformers_ref` -- ``memory_efficient_attention`` with an ``attn_bias`` described by a dict.
"""

from __future__ import annotations

import math

import torch


def _row(scores_row, allowed, values):
    """softmax over the allowed keys of one row (0 when none) times values."""
    idx = [j for j, ok in enumerate(allowed) if ok]
    if not idx:
        return torch.zeros(values.shape[-1], dtype=values.dtype)
    s = scores_row[idx]
    p = torch.softmax(s, dim=0)
    return p @ values[idx]


def flash_attn_ref(
    q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0, key_limit=None
):
    """flash-attn 2.x ``flash_attn_func`` on float64 [B, Sq, H, D] tensors (``key_limit[b]``: keys ``j <
    key_limit[b]`` exist and Sk is taken as ``key_limit[b]`` for the bottom-right offset)."""
    q, k, v = (x.double() for x in (q, k, v))
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    left, right = window_size
    if causal:
        right = 0
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=torch.float64)
    rows = []
    for bi in range(b):
        sk = k.shape[1] if key_limit is None else int(key_limit[bi])
        per_head = []
        for h in range(hq):
            kh = h // (hq // hk)
            s = (q[bi, :, h] @ k[bi, :sk, kh].T) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            head_rows = []
            for i in range(sq):
                centre = i + sk - sq
                allowed = [
                    (left < 0 or j >= centre - left) and (right < 0 or j <= centre + right) for j in range(sk)
                ]
                head_rows.append(_row(s[i], allowed, v[bi, :sk, kh]))
            per_head.append(torch.stack(head_rows))
        rows.append(torch.stack(per_head, dim=1))
    out = torch.stack(rows)
    return out


def flash_attn_varlen_ref(q, k, v, cu_q, cu_k, **kwargs):
    """flash-attn varlen: each sequence ``cu[b]:cu[b+1]`` attends within itself, bottom-right per sequence."""
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        outs.append(flash_attn_ref(q[None, qs], k[None, ks], v[None, ks], **kwargs)[0])
    return torch.cat(outs)


def flash_attn_kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, **kwargs):
    """``flash_attn_with_kvcache``: returns ``(out, k_cache', v_cache')`` (the in-place updated caches)."""
    k_cache, v_cache = k_cache.double().clone(), v_cache.double().clone()
    lengths = [int(x) for x in cache_seqlens]
    if k is not None:
        for b, start in enumerate(lengths):
            k_cache[b, start : start + k.shape[1]] = k[b].double()
            v_cache[b, start : start + v.shape[1]] = v[b].double()
        lengths = [n + k.shape[1] for n in lengths]
    out = flash_attn_ref(q, k_cache, v_cache, key_limit=lengths, **kwargs)
    return out, k_cache, v_cache


def sdpa_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch SDPA semantics on float64 [B, H, S, D]; top-left causal; bool mask True = attend."""
    q, k, v = (x.double() for x in (q, k, v))
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if hk != hq and not enable_gqa:
        raise ValueError("SDPA needs enable_gqa=True for Hk != Hq")
    scale = scale if scale is not None else d**-0.5
    mask = None if attn_mask is None else attn_mask.expand(b, hq, sq, sk)
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64)
    batches = []
    for bi in range(b):
        heads = []
        for h in range(hq):
            kh = h // (hq // hk)
            s = (q[bi, h] @ k[bi, kh].T) * scale
            rows = []
            for i in range(sq):
                allowed = [not is_causal or j <= i for j in range(sk)]
                row = s[i]
                if mask is not None and mask.dtype == torch.bool:
                    allowed = [a and bool(mask[bi, h, i, j]) for j, a in enumerate(allowed)]
                elif mask is not None:
                    row = row + mask[bi, h, i].double()
                rows.append(_row(row, allowed, v[bi, kh]))
            heads.append(torch.stack(rows))
        batches.append(torch.stack(heads))
    out = torch.stack(batches)
    return out


def xformers_ref(q, k, v, bias=None, scale=None):
    """``memory_efficient_attention`` on float64 [B, M, H, K] with ``bias`` described as a dict:

    ``{"kind": "lower_triangular"}`` (top-left), ``{"kind": "bottom_right"}``,
    ``{"kind": "local_bottom_right", "left": l, "right": r}`` (``q - l <= k + Mq - Mk <= q + r``),
    ``{"kind": "block_causal", "q": [...], "kv": [...], "from_bottom_right": bool}`` (B = 1, lengths),
    ``{"kind": "tensor", "bias": t}`` ([B, H, Mq, Mk] additive).
    """
    q, k, v = (x.double() for x in (q, k, v))
    b, mq, h, d = q.shape
    mk = k.shape[1]
    scale = scale if scale is not None else d**-0.5
    kind = (bias or {}).get("kind")

    def allowed(i, j):
        if kind == "lower_triangular":
            return j <= i
        if kind == "bottom_right":
            return j <= i + mk - mq
        if kind == "local_bottom_right":
            shifted = j + mq - mk
            return i - bias["left"] <= shifted <= i + bias["right"]
        if kind == "block_causal":
            qs, ks = _starts(bias["q"]), _starts(bias["kv"])
            bq = max(n for n in range(len(bias["q"])) if qs[n] <= i)
            if not ks[bq] <= j < ks[bq + 1]:
                return False
            qi, kj = i - qs[bq], j - ks[bq]
            offset = (bias["kv"][bq] - bias["q"][bq]) if bias.get("from_bottom_right") else 0
            return kj <= qi + offset
        return True

    batches = []
    for bi in range(b):
        heads = []
        for hi in range(h):
            s = (q[bi, :, hi] @ k[bi, :, hi].T) * scale
            if kind == "tensor":
                s = s + bias["bias"][bi, hi].double()
            heads.append(
                torch.stack([_row(s[i], [allowed(i, j) for j in range(mk)], v[bi, :, hi]) for i in range(mq)])
            )
        batches.append(torch.stack(heads, dim=1))
    return torch.stack(batches)


def _starts(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


__all__ = [
    "flash_attn_kvcache_ref",
    "flash_attn_ref",
    "flash_attn_varlen_ref",
    "math",
    "sdpa_ref",
    "xformers_ref",
]
