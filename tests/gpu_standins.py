"""float64 CPU stand-ins of the GPU libraries, for running *original* (unported) model code.

Written from the libraries' documentation (flash-attn 2.8.3's
``flash_attn_interface.py`` docstrings, FlashAttention-3's ``hopper/flash_attn_interface.py`` before
2025-07-11, xformers 0.0.35's ``attn_bias.py``), vectorized in torch float64 so autograd gives
reference gradients:

* ``flash_attn`` 2.8.3: ``flash_attn_func`` / ``flash_attn_varlen_func`` (``[B, S, H, D]`` /
  ``[total, H, D]`` with ``cu_seqlens``; causal and window bottom-right, ``(l, r)`` inclusive with
  -1 unbounded; softcap; contiguous GQA; ``return_attn_probs`` -> ``(out, lse, S_dmask)``), the
  private ``_flash_attn_forward`` (2.7+: ``(out, lse, S_dmask, rng_state)``), the private
  ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` (2.7+; the backward writes into
  dq/dk/dv), ``__version__``;
* ``flash_attn_interface`` (FA3 as released before 2025-07-11: ``flash_attn_func`` and
  ``flash_attn_varlen_func`` return ``(out, lse)``; the private ``_flash_attn_forward`` /
  ``_flash_attn_backward`` at their 2025-03-15 signatures, the backward writing into dq/dk/dv);
* with ``installed("2025-04-10")``, ``flash_attn_interface`` is FA3's build of that date
  (its private forward with ``seqlens_rotary``/``attention_chunk``, the backward as above);
* ``flash_attn_3.flash_attn_interface._flash_attn_forward``: FA3's private forward at its latest
  (2025-11-21) signature as a plain function, for a paged KV cache (``page_table``, ``seqused_k``);
* with ``installed("sgl-kernel")``, ``flash_attn_interface`` is sgl-kernel's build of FA3 instead
  (``flash_attn_varlen_func(..., return_softmax_lse=True)`` -> ``(out, lse, *accumulators)``;
  ``flash_attn_with_kvcache`` reading a paged cache, with per-head ``sinks``);
* ``flash_attn.ops.triton.cross_entropy.cross_entropy_loss`` (flash-attn 2.8.3's docstring): per row
  ``(lse - logits[label], 0)`` without smoothing, scale or z-loss, rows at ``ignore_index`` zero;
* ``xformers.ops``: ``memory_efficient_attention`` with ``BlockDiagonalMask`` (``from_seqlens``,
  ``make_causal``: top-left per block) and ``LowerTriangularMask``.

lse is ``[B, H, Sq]`` (varlen ``[H, total_q]``), natural log, +inf for a row that sees no key.
Every stand-in function counts its calls in :data:`CALLS`, so a ported run can prove it called none.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import types

import torch

CALLS: collections.Counter = collections.Counter()


def _dense(q, k, v, scale, causal, window, softcap, align="bottom_right", visible=None, sinks=None):
    """(out [B, Sq, H, Dv], lse [B, H, Sq]) of softmax attention on [B, S, H, D] tensors; ``sinks``
    [H]: one logit per head that joins every row's softmax with no value (lse without it)."""
    _b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = qh @ kh.transpose(-1, -2) * (d**-0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    centre = i + (sk - sq if align == "bottom_right" else 0)
    left, right = window
    if causal:
        right = 0
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= centre - left
    if right >= 0:
        ok &= j <= centre + right
    ok = ok if visible is None else ok & visible
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    total = lse if sinks is None else torch.logaddexp(lse, sinks[None, :, None].to(lse.dtype))
    finite = torch.isfinite(total)
    p = torch.where(ok, torch.exp(s - torch.where(finite, total, 0.0)[..., None]), 0.0)
    out = (p @ vh).transpose(1, 2)
    return out, torch.where(finite, lse, float("inf"))


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2.8.3 ``flash_attn_func`` (no dropout, no ALiBi in this stand-in)."""
    CALLS["flash_attn_func"] += 1
    assert not dropout_p and alibi_slopes is None
    out, lse = _dense(q, k, v, softmax_scale, causal, window_size, softcap)
    return (out, lse, q.new_empty(0)) if return_attn_probs else out


def _varlen(q, k, v, cu_q, cu_k, scale, causal, window, softcap):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        out, lse = _dense(q[None, qs], k[None, ks], v[None, ks], scale, causal, window, softcap)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn 2.8.3 ``flash_attn_varlen_func``."""
    CALLS["flash_attn_varlen_func"] += 1
    assert not dropout_p and alibi_slopes is None and block_table is None
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)
    return (out, lse, q.new_empty(0)) if return_attn_probs else out


def _flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    """flash-attn 2.7+'s private forward: ``(out, softmax_lse, S_dmask, rng_state)``."""
    CALLS["_flash_attn_forward"] += 1
    assert not dropout_p and alibi_slopes is None and not return_softmax
    out, lse = _dense(q, k, v, softmax_scale, causal, (window_size_left, window_size_right), softcap)
    return out, lse, None, None


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
    zero_tensors=False,
):
    """flash-attn 2.7+'s private varlen forward: ``(out, softmax_lse [H, total_q], S_dmask, rng_state)``."""
    CALLS["_flash_attn_varlen_forward"] += 1
    assert not dropout_p and alibi_slopes is None and not return_softmax
    assert block_table is None and leftpad_k is None and seqused_k is None
    window = (window_size_left, window_size_right)
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window, softcap)
    return out, lse, None, None


def _flash_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
    zero_tensors=False,
):
    """flash-attn 2.7+'s private varlen backward: the gradients written **into** ``dq``/``dk``/``dv``;
    returns ``softmax_d`` ``[H, total_q]`` (2.8.3)."""
    CALLS["_flash_attn_varlen_backward"] += 1
    assert not dropout_p and alibi_slopes is None
    window = (window_size_left, window_size_right)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        o, _ = _varlen(*leaves, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window, softcap)
        grads = torch.autograd.grad(o, leaves, dout)
    for buffer, g in zip((dq, dk, dv), grads, strict=True):
        buffer.copy_(g)
    return (dout * out).sum(-1).transpose(0, 1)


def fa3_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
):
    """FlashAttention-3 ``flash_attn_varlen_func`` before 2025-07-11: ``(out, softmax_lse)``."""
    CALLS["fa3_flash_attn_varlen_func"] += 1
    assert seqused_q is None and seqused_k is None
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)


def fa3_flash_attn_forward(
    q,
    k,
    v,
    k_new,
    v_new,
    qv,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_k_new,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    page_table,
    kv_batch_idx,
    leftpad_k,
    rotary_cos,
    rotary_sin,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    """FA3's private forward at its 2025-03-15 signature (dense or varlen, no KV cache):
    ``(out, softmax_lse, out_accum, softmax_lse_accum)``."""
    CALLS["fa3_flash_attn_forward"] += 1
    unsupported = (k_new, v_new, qv, out, cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx)
    assert all(x is None for x in unsupported + (leftpad_k, rotary_cos, q_descale, k_descale, v_descale))
    return _fa3_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)


def _fa3_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap):
    if cu_seqlens_q is None:
        out, lse = _dense(q, k, v, softmax_scale, causal, window_size, softcap)
    else:
        out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)
    return out, lse, q.new_empty(0), q.new_empty(0)


def fa3_flash_attn_forward_v2025_04_10(
    q,
    k,
    v,
    k_new,
    v_new,
    qv,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_k_new,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    page_table,
    kv_batch_idx,
    leftpad_k,
    rotary_cos,
    rotary_sin,
    seqlens_rotary,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    """FA3's private forward at its 2025-04-10 signature (``seqlens_rotary``, ``attention_chunk``
    added), dense or varlen: ``(out, softmax_lse, out_accum, softmax_lse_accum)``."""
    CALLS["fa3_flash_attn_forward_v2025_04_10"] += 1
    unsupported = (k_new, v_new, qv, out, cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx)
    assert all(x is None for x in unsupported + (leftpad_k, rotary_cos, q_descale, k_descale, v_descale))
    assert not attention_chunk
    return _fa3_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)


def fa3_latest_flash_attn_forward(
    q,
    k,
    v,
    k_new=None,
    v_new=None,
    qv=None,
    out_=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    cu_seqlens_k_new=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    page_table=None,
    kv_batch_idx=None,
    leftpad_k=None,
    rotary_cos=None,
    rotary_sin=None,
    seqlens_rotary=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size_left=-1,
    window_size_right=-1,
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    """FA3's private forward at its latest (2025-11-21) signature, for a paged KV cache only:
    ``k``/``v`` ``[num_pages, page_size, Hk, D]``, ``page_table`` ``[B, pages]``, ``seqused_k`` the
    cache lengths, ``q`` varlen by ``cu_seqlens_q``; bottom-right causal per sequence. Returns
    ``(out [total_q, H, Dv], softmax_lse [H, total_q], out_accum, softmax_lse_accum)``."""
    CALLS["fa3_latest_flash_attn_forward"] += 1
    assert page_table is not None and cu_seqlens_q is not None and seqused_k is not None
    assert all(x is None for x in (k_new, v_new, qv, out_, cu_seqlens_k, seqused_q, kv_batch_idx, leftpad_k))
    assert rotary_cos is None and q_descale is None and not attention_chunk
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        n = int(seqused_k[b])
        keys = k[page_table[b].long()].flatten(0, 1)[None, :n]
        values = v[page_table[b].long()].flatten(0, 1)[None, :n]
        window = (window_size_left, window_size_right)
        out, lse = _dense(q[None, rows], keys, values, softmax_scale, causal, window, softcap)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1), q.new_empty(0), q.new_empty(0)


def sgl_flash_attn_with_kvcache(
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
    attention_chunk=None,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    only_qv=False,
    sm_margin=0,
    return_softmax_lse=False,
    sinks=None,
    out=None,
):
    """sgl-kernel's build of FA3's ``flash_attn_with_kvcache`` (sglang 0.5.23's
    ``flash_attention_v3.py``), for a paged cache read only: ``k_cache``/``v_cache``
    ``[num_pages, page_size, Hk, D]``, ``page_table`` ``[B, pages]``, ``cache_seqlens`` the lengths,
    ``q`` varlen by ``cu_seqlens_q``; bottom-right causal/window per sequence; ``sinks`` [H] join each
    row's softmax without a value. Returns ``out`` (``return_softmax_lse`` not modelled)."""
    CALLS["sgl_flash_attn_with_kvcache"] += 1
    assert k is None and v is None and qv is None and rotary_cos is None and cache_batch_idx is None
    assert cache_leftpad is None and cu_seqlens_k_new is None and q_descale is None and k_descale is None
    assert page_table is not None and cu_seqlens_q is not None and not attention_chunk
    assert not only_qv and not return_softmax_lse and out is None
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        n = int(cache_seqlens[b])
        keys = k_cache[page_table[b].long()].flatten(0, 1)[None, :n]
        values = v_cache[page_table[b].long()].flatten(0, 1)[None, :n]
        result, _ = _dense(
            q[None, rows], keys, values, softmax_scale, causal, window_size, softcap, sinks=sinks
        )
        outs.append(result[0])
    return torch.cat(outs)


def fa3_flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    sequed_q,
    sequed_k,
    max_seqlen_q,
    max_seqlen_k,
    dq,
    dk,
    dv,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    sm_margin=0,
):
    """FA3's private backward at its 2025-03-01..2025-07-16 signature: the gradients of the
    attention whose output ``out`` was, written **into** ``dq``/``dk``/``dv``; returns
    ``(dq, dk, dv, softmax_d)`` with ``softmax_d = rowsum(dout * out)`` ``[B, H, Sq]``."""
    CALLS["fa3_flash_attn_backward"] += 1
    assert sequed_q is None and sequed_k is None
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        if cu_seqlens_q is None:
            o, _ = _dense(*leaves, softmax_scale, causal, window_size, softcap)
        else:
            o, _ = _varlen(*leaves, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)
        grads = torch.autograd.grad(o, leaves, dout)
    for buffer, g in zip((dq, dk, dv), grads, strict=True):
        buffer.copy_(g)
    softmax_d = (dout * out).sum(-1)
    return dq, dk, dv, softmax_d.transpose(-1, -2) if cu_seqlens_q is None else softmax_d.transpose(0, 1)


def sgl_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    only_qv=False,
    sm_margin=0,
    return_softmax_lse=False,
    sinks=None,
    out=None,
):
    """sgl-kernel's build of FA3's ``flash_attn_varlen_func`` (as sglang 0.5.23 vendors it in
    ``sglang/kernels/ops/attention/flash_attention_v3.py``; MUSA's ``flash_attn_interface`` copies it):
    dense ``[B, S, H, D]`` without ``cu_seqlens``; returns ``out``, or ``(out, softmax_lse,
    out_accum, softmax_lse_accum)`` with ``return_softmax_lse=True``."""
    CALLS["sgl_flash_attn_varlen_func"] += 1
    assert sinks is None and out is None and page_table is None and qv is None
    assert seqused_q is None and seqused_k is None and not attention_chunk
    if cu_seqlens_q is None:
        result, lse = _dense(q, k, v, softmax_scale, causal, window_size, softcap)
    else:
        result, lse = _varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap
        )
    return (result, lse, q.new_empty(0), q.new_empty(0)) if return_softmax_lse else result


class AttentionBias:
    """xformers' bias base class."""


class LowerTriangularMask(AttentionBias):
    """Causal, top-left."""

    def visible(self, mq, mk):
        return torch.ones(mq, mk, dtype=torch.bool).tril()


class BlockDiagonalMask(AttentionBias):
    """Packed sequences (B = 1): a query block sees only its key block."""

    causal = False

    def __init__(self, q_seqlen, kv_seqlen):
        self.q_seqlen, self.kv_seqlen = list(q_seqlen), list(kv_seqlen)

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen)

    def make_causal(self):
        return BlockDiagonalCausalMask(self.q_seqlen, self.kv_seqlen)

    def visible(self, mq, mk):
        ok = torch.zeros(mq, mk, dtype=torch.bool)
        qs = ks = 0
        for nq, nk in zip(self.q_seqlen, self.kv_seqlen, strict=True):
            block = torch.ones(nq, nk, dtype=torch.bool)
            ok[qs : qs + nq, ks : ks + nk] = block.tril() if self.causal else block
            qs, ks = qs + nq, ks + nk
        return ok


class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Causal per block, top-left."""

    causal = True


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
    """xformers ``memory_efficient_attention`` on [B, M, H, K] (bias objects above, or a tensor)."""
    CALLS["memory_efficient_attention"] += 1
    assert not p
    mq, mk = query.shape[1], key.shape[1]
    visible = attn_bias.visible(mq, mk) if isinstance(attn_bias, AttentionBias) else None
    return _dense(query, key, value, scale, False, (-1, -1), 0.0, visible=visible)[0]


def cross_entropy_loss(
    logits,
    labels,
    precomputed_lse=None,
    label_smoothing=0.0,
    logit_scale=1.0,
    lse_square_scale=0.0,
    ignore_index=-100,
    inplace_backward=False,
    process_group=None,
):
    """flash-attn's fused cross entropy, for the plain case its docstring states: (losses, z_losses)."""
    CALLS["cross_entropy_loss"] += 1
    assert precomputed_lse is None and label_smoothing == 0.0 and logit_scale == 1.0
    assert lse_square_scale == 0.0 and process_group is None
    z = logits.double()
    picked = z.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    losses = torch.where(labels == ignore_index, 0.0, torch.logsumexp(z, dim=-1) - picked)
    return losses, torch.zeros_like(losses)


def _module(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def modules() -> dict[str, types.ModuleType]:
    """The stand-in modules by import name."""
    fa2 = dict(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)
    interface = _module(
        "flash_attn.flash_attn_interface",
        _flash_attn_forward=_flash_attn_forward,
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_flash_attn_varlen_backward,
        **fa2,
    )
    bias = _module(
        "xformers.ops.fmha.attn_bias",
        AttentionBias=AttentionBias,
        BlockDiagonalMask=BlockDiagonalMask,
        BlockDiagonalCausalMask=BlockDiagonalCausalMask,
        LowerTriangularMask=LowerTriangularMask,
    )
    fmha = _module("xformers.ops.fmha", attn_bias=bias, memory_efficient_attention=memory_efficient_attention)
    ops = _module(
        "xformers.ops",
        fmha=fmha,
        memory_efficient_attention=memory_efficient_attention,
        AttentionBias=AttentionBias,
        LowerTriangularMask=LowerTriangularMask,
    )
    return {
        "flash_attn": _module("flash_attn", __version__="2.8.3", flash_attn_interface=interface, **fa2),
        "flash_attn.flash_attn_interface": interface,
        "flash_attn_interface": _module(
            "flash_attn_interface",
            flash_attn_varlen_func=fa3_flash_attn_varlen_func,
            _flash_attn_forward=fa3_flash_attn_forward,
            _flash_attn_backward=fa3_flash_attn_backward,
        ),
        "flash_attn_3": _module("flash_attn_3"),
        "flash_attn_3.flash_attn_interface": _module(
            "flash_attn_3.flash_attn_interface", _flash_attn_forward=fa3_latest_flash_attn_forward
        ),
        "flash_attn.ops": _module("flash_attn.ops"),
        "flash_attn.ops.triton": _module("flash_attn.ops.triton"),
        "flash_attn.ops.triton.cross_entropy": _module(
            "flash_attn.ops.triton.cross_entropy", cross_entropy_loss=cross_entropy_loss
        ),
        "xformers": _module("xformers", ops=ops),
        "xformers.ops": ops,
        "xformers.ops.fmha": fmha,
        "xformers.ops.fmha.attn_bias": bias,
    }


@contextlib.contextmanager
def installed(fa3_build: str = "flash-attention"):
    """The stand-ins importable under the GPU libraries' names, for the original code's run;
    ``fa3_build="sgl-kernel"`` makes ``flash_attn_interface`` sgl-kernel's build of FA3,
    ``fa3_build="2025-04-10"`` FA3's build of that date (its private forward's signature)."""
    standins = modules()
    if fa3_build == "2025-04-10":
        standins["flash_attn_interface"] = _module(
            "flash_attn_interface",
            _flash_attn_forward=fa3_flash_attn_forward_v2025_04_10,
            _flash_attn_backward=fa3_flash_attn_backward,
        )
    if fa3_build == "sgl-kernel":
        standins["flash_attn_interface"] = _module(
            "flash_attn_interface",
            flash_attn_varlen_func=sgl_flash_attn_varlen_func,
            flash_attn_with_kvcache=sgl_flash_attn_with_kvcache,
        )
    saved = {name: sys.modules.get(name) for name in standins}
    sys.modules.update(standins)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
