"""Score computation shared by the XLA backends: one (query block, key block) tile at a time.

Queries are kept grouped as [B, Hkv, G, Sq, D] so GQA/MQA never repeats K/V: every tile is an
einsum against the kv head the group shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashport.kernels.spec import AttentionSpec, apply_softcap, positional_visible


def matmul_precision(dtype):
    """The ``precision`` of the XLA backends' matmuls for operands of ``dtype``.

    The contract computes float32 inputs in float32. XLA's default on CUDA runs float32 matmuls in
    TF32 (about 1e-3 relative error), so float32 operands get ``Precision.HIGHEST`` unless the caller
    chose a precision with ``jax.default_matmul_precision`` (or the ``jax_default_matmul_precision``
    flag), which is then honoured. bfloat16/float16 operands keep the default (their products are
    exact in the float32 accumulator).
    """
    if jnp.dtype(dtype) != jnp.float32 or jax.config.jax_default_matmul_precision is not None:
        return None
    return jax.lax.Precision.HIGHEST


def group_heads(x, hkv):
    """[B, Hq, S, D] -> [B, Hkv, G, S, D] (contiguous groups: head h -> kv head h // G)."""
    b, hq, s, d = x.shape
    return x.reshape(b, hkv, hq // hkv, s, d)


def group_broadcastable(x, hkv):
    """A rank-4 bias/mask [Bb, H|1, Sq|1, Sk|1] -> rank 5 grouped like the queries."""
    if x is None:
        return None
    b, h, sq, sk = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, sq, sk)
    return x.reshape(b, hkv, h // hkv, sq, sk)


def _flat(x):
    """[B, Hkv, (G,) n, d] -> [B·Hkv, (G·)n, d]: a bitcast for contiguous tiles."""
    return x.reshape(x.shape[0] * x.shape[1], -1, x.shape[-1])


def _batched(a, b, contract_a: int, contract_b: int, precision):
    dims = (((contract_a,), (contract_b,)), ((0,), (0,)))
    return jax.lax.dot_general(
        _flat(a), _flat(b), dims, precision=precision, preferred_element_type=jnp.float32
    )


# The three tile products of flash attention, each one rank-3 batched matmul per (batch, kv head)
# with the G query heads of a group stacked as rows. XLA:CPU hands such canonical dots to its fast
# matmul library (YNNPACK) and fuses the reductions around them; the rank-5 einsums they replace
# ("bhgqd,bhkd->bhgqk") were lowered as generic dots with a transposed copy of K per tile.


def scores_product(q, k, precision=None):
    """Q·Kᵀ of grouped tiles: q [B, Hkv, G, bq, D], k [B, Hkv, bk, D] -> float32 [B, Hkv, G, bq, bk]."""
    return _batched(q, k, 2, 2, precision).reshape(*q.shape[:-1], k.shape[2])


def rows_product(p, v, precision=None):
    """P·V of grouped tiles: p [B, Hkv, G, bq, bk], v [B, Hkv, bk, D] -> float32 [B, Hkv, G, bq, D]."""
    return _batched(p, v, 2, 1, precision).reshape(*p.shape[:-1], v.shape[-1])


def keys_product(p, x, precision=None):
    """Pᵀ·X summed over the group: p [B, Hkv, G, bq, bk], x [B, Hkv, G, bq, D] -> float32
    [B, Hkv, bk, D] (dV = Pᵀ·dO and dK = dSᵀ·Q).

    Computed as (Xᵀ·P)ᵀ: the small X tile is transposed instead of the scores tile, which keeps the
    big operand in the layout XLA:CPU's matmul library takes (a dot contracting both operands' row
    axis is lowered as a generic dot)."""
    xt = jax.lax.optimization_barrier(jnp.swapaxes(_flat(x), 1, 2))  # or XLA folds it into the dot
    dims = (((2,), (1,)), ((0,), (0,)))
    out = jax.lax.dot_general(xt, _flat(p), dims, precision=precision, preferred_element_type=jnp.float32)
    return jnp.swapaxes(jax.lax.optimization_barrier(out), 1, 2).reshape(
        *p.shape[:2], p.shape[-1], x.shape[-1]
    )


def tile_logits(
    spec: AttentionSpec,
    q,
    k,
    q_pos,
    k_pos,
    bias=None,
    mask=None,
    q_seg=None,
    kv_seg=None,
    *,
    positional=True,
    q_prescaled=False,
):
    """Scores of one tile with everything of the contract applied.

    Args:
      q: [B, Hkv, G, bq, D]; k: [B, Hkv, bk, D].
      q_pos: int [bq] absolute query positions; k_pos: int [bk] absolute key positions.
      bias / mask: grouped tiles broadcastable to [B, Hkv, G, bq, bk].
      q_seg: [B, bq]; kv_seg: [B, bk].
      positional: apply causal/window/length masking; pass False for tiles known to be fully
        visible (saves the iota compares and selects).
      q_prescaled: ``q`` already carries ``spec.scale``.

    Returns:
      ``(logits, visible, raw)``: float32 logits with hidden entries at -inf, the boolean visibility,
      and the pre-softcap scaled scores (backward passes need them for the tanh derivative).
    """
    raw = scores_product(q, k, matmul_precision(q.dtype))
    if not q_prescaled:
        raw = raw * spec.scale
    logits = apply_softcap(spec, raw, jnp)
    if bias is not None:
        logits = logits + bias
    visible = (
        positional_visible(spec, q_pos[:, None], k_pos[None, :])[None, None, None] if positional else None
    )
    if mask is not None:
        visible = mask if visible is None else visible & mask
    if q_seg is not None:
        same = q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :]
        visible = same if visible is None else visible & same
    if visible is None:  # fully visible tile: logits are final, every entry counts
        return logits, jnp.ones((), bool), raw
    return jnp.where(visible, logits, -jnp.inf), visible, raw
