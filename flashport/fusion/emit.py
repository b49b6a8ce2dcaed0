"""Build the ``flashport.attention`` call that replaces one matched site."""

from __future__ import annotations

import math

import jax.numpy as jnp

from flashport.fusion.canon import is_key_padding, to_canonical


def emit(match, read, backend):
    """Compute the replacement of ``match.anchor``'s output from the environment ``read``."""
    from flashport.kernels.contract.api import attention

    sz = match.sizes
    b, h, g = math.prod(sz["B"]), sz["H"] or 1, math.prod(sz["G"])
    dtype = jnp.dtype(match.dtype)
    q = _canon(read(match.q), match.q_order, (b, sz["T"], h * g, sz["D"]), dtype)
    hkv = sz.get("Hkv") or h  # fewer than h when a head repeat of K/V was folded (see .gqa)
    k = _canon(read(match.k), match.k_order, (b, sz["S"], hkv, sz["D"]), dtype)
    v = _canon(read(match.v), match.v_order, (b, sz["S"], hkv, sz["Dv"]), dtype)
    bias, mask, segments = _terms(match, read, b)
    need_lse = match.empty in ("mean", "nan")
    drop = {}
    if match.dropout is not None:
        drop = {"dropout_rate": match.dropout.rate, "dropout_rng": match.dropout.key(read)}
    res = attention(
        q,
        k,
        v,
        scale=match.scale,
        causal=match.causal,
        window=match.window,
        align=match.align,
        softcap=match.softcap,
        bias=bias,
        mask=mask,
        layout="BSHD",
        backend=backend,
        return_lse=need_lse,
        **segments,
        **drop,
    )
    out = _empty_rows(match, res, v, h * g // hkv) if need_lse else res
    out = out.astype(match.out_dtype)
    out = jnp.reshape(out, [*sz["B"], sz["T"], *([sz["H"]] if sz["H"] else []), *sz["G"], sz["Dv"]])
    return jnp.transpose(out, match.out_perm)


def _terms(match, read, b):
    """The contract's ``bias``, ``mask`` and segment-id arguments from the site's bias/mask terms."""
    sz = match.sizes
    full = _full_sizes(match)
    bias = None
    for term in match.biases:
        val = to_canonical(jnp, read(term.var), term.dmap, match.canon_dims, full, match.groups)
        val = val.astype(jnp.float32) * term.mult
        bias = val if bias is None else bias + val
    mask = pad = None
    for term in match.masks:
        val = to_canonical(jnp, read(term.var), term.dmap, match.canon_dims, full, match.groups)
        val = val.astype(bool) if term.keep_when_true else ~val.astype(bool)
        if is_key_padding(term.dmap, match.canon_dims, match.groups):  # [B|1, 1, 1, S|1]
            val = jnp.broadcast_to(val[:, 0, 0, :], (b, sz["S"]))
            pad = val if pad is None else pad & val
        else:
            mask = val if mask is None else mask & val
    segments = {}
    if pad is not None:  # key padding as segment ids: query id 1, key id 1 (kept) or 0 (padded)
        segments = {
            "q_segment_ids": jnp.ones((b, sz["T"]), jnp.int32),
            "kv_segment_ids": pad.astype(jnp.int32),
        }
    return bias, mask, segments


def _empty_rows(match, res, v, reps):
    """Rows with no visible key as the original computes them: ``mean(V)`` or NaN (not the contract's 0)."""
    out, lse = res
    empty = jnp.transpose(lse == -jnp.inf, (0, 2, 1))[..., None]  # [B, T, Hq, 1]
    if match.empty == "mean":
        fill = jnp.mean(v.astype(jnp.float32), axis=1, keepdims=True)  # [B, 1, Hkv, Dv]
        fill = jnp.repeat(fill, reps, axis=2).astype(out.dtype)
    else:
        fill = jnp.full((), jnp.nan, out.dtype)
    return jnp.where(empty, fill, out)


def _full_sizes(match):
    sz = match.sizes
    return [*sz["B"], *([sz["H"]] if sz["H"] else []), *sz["G"], sz["T"], sz["S"]]


def _canon(x, order, shape4, dtype):
    x = jnp.transpose(x, order)
    return jnp.reshape(x, shape4).astype(dtype)
