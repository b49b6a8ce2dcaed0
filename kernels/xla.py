"""The ``xla`` backend: plain materialized softmax attention (O(Sq·Sk) memory), differentiated by JAX.

The reference-quality path on every platform: every feature of the contract, float32 softmax and
accumulation, GQA through grouped einsums (K/V never repeated). ``auto`` uses it on CPU for short
sequences, where it beats the blockwise loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashport.kernels import dropout, registry
from flashport.kernels.scores import group_broadcastable, group_heads, matmul_precision, tile_logits
from flashport.kernels.spec import FEATURES


def xla_attention(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec, options):
    """Materialized attention over the canonical arrays; returns ``(out, lse)``."""
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
    out = jnp.einsum("bhgqk,bhkd->bhgqd", p, v.astype(jnp.float32), precision=matmul_precision(v.dtype)) / l_safe
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    return out.reshape(b, hq, sq, v.shape[-1]).astype(q.dtype), lse.reshape(b, hq, sq)


registry.register(
    registry.BackendInfo(
        name="xla",
        description="Plain XLA softmax attention, materializes [B, H, Sq, Sk] scores; any platform.",
        platforms=("cpu", "cuda", "rocm", "tpu"),
        features=frozenset(FEATURES),
        fn=xla_attention,
    )
)
