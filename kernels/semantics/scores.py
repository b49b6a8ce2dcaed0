"""Score computation shared by the XLA backends: one (query block, key block) tile at a time.

Queries are kept grouped as [B, Hkv, G, Sq, D] so GQA/MQA never repeats K/V: every tile is an
einsum against the kv head the group shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashport.kernels.contract.spec import AttentionSpec, apply_softcap, positional_visible


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


def grouped_einsum(subscripts, *operands, **kwargs):
    """``jnp.einsum`` over grouped operands with the group axis merged into the rows.

    Operands written ``bhgq…`` ([B, Hkv, G, rows, cols]) are contracted as [B, Hkv, G·rows, cols],
    so XLA sees one rank-4 batched matmul (on CPU: no transposed copy of the shared K/V tile, which
    the rank-5 form costs per tile); a ``bhgq…`` output is split back. Same numbers as the einsum.
    """
    ins, out = subscripts.split("->")
    merged, group = [], None
    for term, x in zip(ins.split(","), operands, strict=True):
        if term.startswith("bhgq"):
            group = x.shape[2]
            x = x.reshape(x.shape[0], x.shape[1], group * x.shape[3], *x.shape[4:])
        merged.append(x)
    spec = subscripts.replace("bhgq", "bhq")
    result = jnp.einsum(spec, *merged, **kwargs)
    if out.startswith("bhgq"):
        b, h, rows = result.shape[:3]
        result = result.reshape(b, h, group, rows // group, *result.shape[3:])
    return result


def group_broadcastable(x, hkv):
    """A rank-4 bias/mask [Bb, H|1, Sq|1, Sk|1] -> rank 5 grouped like the queries."""
    if x is None:
        return None
    b, h, sq, sk = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, sq, sk)
    return x.reshape(b, hkv, h // hkv, sq, sk)


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
    mods=None,
    mask_mod=True,
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
      mods: a :class:`flashport.kernels.semantics.mods.Mods` (score_mod after softcap and bias, mask_mod
        and-ed into the visibility) or None.
      mask_mod: evaluate ``mods``' mask_mod; pass False for tiles its block mask marks full.

    Returns:
      ``(logits, visible, raw)``: float32 logits with hidden entries at -inf, the boolean visibility,
      and the pre-softcap scaled scores (backward passes need them for the tanh derivative).
    """
    raw = grouped_einsum(
        "bhgqd,bhkd->bhgqk", q, k, preferred_element_type=jnp.float32, precision=matmul_precision(q.dtype)
    )
    if not q_prescaled:
        raw = raw * spec.scale
    logits = apply_softcap(spec, raw, jnp)
    if bias is not None:
        logits = logits + bias
    visible = (
        positional_visible(spec, q_pos[:, None], k_pos[None, :])[None, None, None] if positional else None
    )
    if mods is not None:
        b, h, qi, ki = tile_indices(q, q_pos, k_pos)
        logits = mods.apply_score(logits, b, h, qi, ki)
        seen = mods.visible(b, h, qi, ki) if mask_mod else None
        if seen is not None:
            visible = seen if visible is None else visible & seen
    if mask is not None:
        visible = mask if visible is None else visible & mask
    if q_seg is not None:
        same = q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :]
        visible = same if visible is None else visible & same
    if visible is None:  # fully visible tile: logits are final, every entry counts
        return logits, jnp.ones((), bool), raw
    return jnp.where(visible, logits, -jnp.inf), visible, raw


def tile_indices(q, q_pos, k_pos):
    """The (batch, query head, q_idx, kv_idx) index arrays of a grouped score tile of ``q``
    [B, Hkv, G, bq, D] at positions ``q_pos`` [bq] / ``k_pos`` [bk], broadcasting to
    [B, Hkv, G, bq, bk] (query head ``h = kv_head * G + g``): what a mod sees."""
    batch, hkv, groups = q.shape[:3]
    b = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1, 1)
    h = jnp.arange(hkv * groups, dtype=jnp.int32).reshape(1, hkv, groups, 1, 1)
    qi = jnp.asarray(q_pos, jnp.int32).reshape(1, 1, 1, -1, 1)
    ki = jnp.asarray(k_pos, jnp.int32).reshape(1, 1, 1, 1, -1)
    return b, h, qi, ki


def mod_score_grad(spec: AttentionSpec, mods, q, raw, bias, q_pos, k_pos):
    """d score_mod / d score of a tile from its pre-softcap scaled scores ``raw`` and bias tile
    (``None`` when ``mods`` has no score_mod): backward passes multiply dL/dlogits by it."""
    if mods is None or mods.score is None:
        return None
    pre = apply_softcap(spec, raw, jnp)
    if bias is not None:
        pre = pre + bias
    return mods.score_derivative(pre, *tile_indices(q, q_pos, k_pos))
