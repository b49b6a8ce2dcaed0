"""Reorder and merge operand dims into flashport's canonical shapes (works on numpy and jax arrays)."""

from __future__ import annotations

import math


def to_canonical(xp, val, dmap, canon_dims, full_sizes, groups):
    """Bias/mask ``val`` whose dims map to QK-output dims (``dmap``) -> rank-4 [B, Hq, T, S].

    ``canon_dims`` lists the QK-output dims in canonical order and ``groups`` which canonical
    positions merge into B, Hq, T and S. Dims that ``val`` lacks stay size 1 (broadcast) unless they
    must be merged with a non-broadcast neighbour, in which case that group is materialized.
    """
    keep = [i for i, d in enumerate(dmap) if d is not None]
    val = xp.reshape(val, [val.shape[i] for i in keep])
    present = [dmap[i] for i in keep]
    pos = [canon_dims.index(d) for d in present]
    order = sorted(range(len(pos)), key=lambda j: pos[j])
    val = xp.transpose(val, order)
    sizes = [1] * len(canon_dims)
    for j in order:
        sizes[pos[j]] = val.shape[order.index(j)]
    val = xp.reshape(val, sizes)
    out_shape = []
    target = list(sizes)
    for grp in groups:
        big = [i for i in grp if sizes[i] != 1]
        if len(big) > 1 or (big and len(grp) > 1 and any(full_sizes[i] != 1 for i in grp if i not in big)):
            for i in grp:
                target[i] = full_sizes[i]
    if target != sizes:
        val = xp.broadcast_to(val, target)
    for grp in groups:
        out_shape.append(math.prod(target[i] for i in grp) if grp else 1)
    return xp.reshape(val, out_shape)


def is_key_padding(dmap, canon_dims, groups) -> bool:
    """Whether a mask with dims ``dmap`` varies only over batch and keys: a [B, 1, 1, S] key padding.

    Such a mask means the same as ``kv_segment_ids = mask`` with ``q_segment_ids`` all ones.
    """
    allowed = {canon_dims[i] for i in (*groups[0], *groups[3])}
    return all(d is None or d in allowed for d in dmap)
