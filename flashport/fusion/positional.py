"""Recognize causal / sliding-window masks among the constant masks of a match.

Masks built from ``iota`` comparisons (``jnp.tril``, ``arange`` comparisons, flax
``make_causal_mask``, jax.nn ``is_causal``/``local_window_size``) or passed as constant arrays are
evaluated at trace time, projected onto (query, key) and fitted to the contract's
``causal``/``window``/``align`` parameters. Fitting is exact: the fitted parameters must reproduce
every element, otherwise the masks are kept as a generic boolean mask.
"""

from __future__ import annotations

import numpy as np

from flashport.fusion.canon import to_canonical


def extract(g, masks, canon_dims, out_shape, groups):
    """Split ``masks`` into a positional part and generic rest.

    Returns ``(causal, window, align, empty_fill, rest)``; ``empty_fill`` is the fill of the
    positional masks when they leave some query row with no key (else None).
    """
    full = [out_shape[d] for d in canon_dims]
    const, rest = [], []
    for m in masks:
        val = g.const_value(m.var)
        if val is None:
            rest.append(m)
            continue
        arr = np.asarray(to_canonical(np, val.astype(bool), m.dmap, canon_dims, full, groups))
        if not m.keep_when_true:
            arr = ~arr
        plane = arr[:1, :1]
        if not np.all(arr == plane):  # varies over batch or heads: not positional
            rest.append(m)
            continue
        const.append((m, plane[0, 0]))
    if not const:
        return False, None, "bottom_right", None, masks
    fills = {m.fill for m, _ in const}
    if len(fills) > 1:
        return False, None, "bottom_right", None, masks
    t, s = full[-2], full[-1]
    visible = np.ones((t, s), bool)
    for _, plane in const:
        visible &= np.broadcast_to(plane, (t, s))
    fill = fills.pop()
    if visible.all():
        return False, None, "bottom_right", None, rest
    fit = fit_positional(visible)
    if fit is None:
        return False, None, "bottom_right", None, masks
    causal, window, align = fit
    empty = fill if not visible.any(axis=1).all() else None
    return causal, window, align, empty, rest


def fit_positional(visible):
    """Fit a [T, S] boolean plane to ``(causal, window, align)`` exactly, or return None."""
    t, s = visible.shape
    rows = visible.any(axis=1)
    if not rows.any():
        return None
    lo = np.argmax(visible, axis=1)
    hi = s - 1 - np.argmax(visible[:, ::-1], axis=1)
    i = np.arange(t)
    for align, offset in (("bottom_right", s - t), ("top_left", 0)):
        diag = i + offset
        rights = set((hi - diag)[rows & (hi < s - 1)].tolist())
        lefts = set((diag - lo)[rows & (lo > 0)].tolist())
        if len(rights) > 1 or len(lefts) > 1:
            continue
        right = rights.pop() if rights else None
        left = lefts.pop() if lefts else None
        if (right is not None and right < 0) or (left is not None and left < 0):
            continue
        j = np.arange(s)[None, :]
        expect = np.ones((t, s), bool)
        if right is not None:
            expect &= j <= diag[:, None] + right
        if left is not None:
            expect &= j >= diag[:, None] - left
        if not np.array_equal(expect, visible):
            continue
        if right == 0:
            return True, (None if left is None else (left, None)), align
        return False, (left, right), align
    return None
