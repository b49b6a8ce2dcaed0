"""The ``xla`` backend: plain materialized softmax attention (O(Sq·Sk) memory), differentiated by JAX.

The reference-quality path on every platform: every feature of the contract, float32 softmax and
accumulation, GQA through grouped einsums (K/V never repeated). ``auto`` uses it on CPU for short
sequences, where it beats the blockwise loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import FEATURES
from flashport.kernels.semantics import dropout
from flashport.kernels.semantics.scores import group_broadcastable, group_heads, matmul_precision, tile_logits


def xla_attention(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec, options, mods=None):
    """Materialized attention over the canonical arrays; returns ``(out, lse)``. ``mods``
    (:mod:`flashport.kernels.semantics.mods`) run over the whole score matrix; JAX differentiates them."""
    if options:
        raise ValueError(f"backend 'xla' takes no options, got {sorted(options)}")
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    logits, _, _ = tile_logits(
        spec,
        group_heads(q, hkv),
        k,
        jnp.arange(sq),
        jnp.arange(k.shape[2]),
        group_broadcastable(bias, hkv),
        group_broadcastable(mask, hkv),
        q_seg,
        kv_seg,
        mods=mods,
    )
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    l_safe = jnp.where(l > 0, l, 1.0)
    if spec.dropout_rate > 0:
        t_bh = dropout.grouped_head_seeds(seed, b, hkv, hq // hkv)[..., None, None]
        keep = dropout.keep_mask(spec.dropout_rate, t_bh, jnp.arange(sq)[:, None], jnp.arange(k.shape[2]))
        p = dropout.apply(p, keep, spec.dropout_rate)
    out = (
        jnp.einsum("bhgqk,bhkd->bhgqd", p, v.astype(jnp.float32), precision=matmul_precision(v.dtype))
        / l_safe
    )
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    return out.reshape(b, hq, sq, v.shape[-1]).astype(q.dtype), lse.reshape(b, hq, sq)


def xla_attention_backward(
    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse, *, spec, options, mods=None
):
    """The residual backward of :func:`xla_attention`: ``(dq, dk, dv, dbias)`` from ``out`` and ``lse``.

    Recomputes the scores Q·Kᵀ (every flash backward does) and P = exp(logits - lse); the softmax
    normalizer and the output P·V are not recomputed. With D = dL/dlogits = P * (dP - delta) and
    delta = rowsum(dO * O) - dlse, the four gradient products are dV = P_dropᵀ·dO, dP = dO·Vᵀ and the
    pull-back of D through the score function (dQ = D·K, dK = Dᵀ·Q, plus softcap, scale and bias).
    """
    if options:
        raise ValueError(f"backend 'xla' takes no options, got {sorted(options)}")
    b, hq, sq, _d = q.shape
    hkv, sk = k.shape[1], k.shape[2]

    def logits_of(q, k, bias):
        logits, _, _ = tile_logits(
            spec,
            group_heads(q, hkv),
            k,
            jnp.arange(sq),
            jnp.arange(sk),
            group_broadcastable(bias, hkv),
            group_broadcastable(mask, hkv),
            q_seg,
            kv_seg,
            mods=mods,
        )
        return logits

    logits, pull_back = jax.vjp(logits_of, q, k, bias)
    lse_g = group_heads(lse[..., None], hkv)
    seen = lse_g > -jnp.inf  # rows that see at least one key
    p = jnp.where(seen, jnp.exp(logits - jnp.where(seen, lse_g, 0.0)), 0.0)
    d_out_g = group_heads(d_out, hkv).astype(jnp.float32)
    delta = jnp.sum(d_out_g * group_heads(out, hkv).astype(jnp.float32), axis=-1, keepdims=True)
    delta = delta - group_heads(d_lse[..., None], hkv)
    keep = None
    if spec.dropout_rate > 0:
        t_bh = dropout.grouped_head_seeds(seed, b, hkv, hq // hkv)[..., None, None]
        keep = dropout.keep_mask(spec.dropout_rate, t_bh, jnp.arange(sq)[:, None], jnp.arange(sk))
    p_kept = p if keep is None else dropout.apply(p, keep, spec.dropout_rate)
    prec = matmul_precision(q.dtype)
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", p_kept, d_out_g, precision=prec)
    dp = jnp.einsum("bhgqd,bhkd->bhgqk", d_out_g, v.astype(jnp.float32), precision=prec)
    if keep is not None:
        dp = dropout.apply(dp, keep, spec.dropout_rate)
    dq, dk, dbias = pull_back(jnp.where(seen, p * (dp - delta), 0.0))
    return dq, dk, dv.astype(v.dtype), dbias


registry.register(
    registry.BackendInfo(
        name="xla",
        description="Plain XLA softmax attention, materializes [B, H, Sq, Sk] scores; any platform.",
        platforms=("cpu", "cuda", "rocm", "tpu"),
        features=frozenset(FEATURES),
        fn=xla_attention,
        backward=xla_attention_backward,
    )
)
