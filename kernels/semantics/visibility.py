"""The one definition of which key positions a query may see through causal and window structure.

Every implementation of the contract uses :func:`band_visible`: the XLA and blockwise backends
(through :func:`flashport.kernels.contract.spec.positional_visible`), the Pallas kernels, the torch paths,
the kv-cache and varlen helpers. It is written with Python operators only (``<=``, ``>=``, ``&``),
so it works unchanged on numpy, JAX (also inside Pallas kernels) and torch arrays, and this module
imports no framework.

Query ``i`` sits at key position ``diag = i + offset`` (``offset = Sk - Sq`` for bottom-right
alignment, 0 for top-left, or a per-sequence value for kv caches and packed sequences). It sees
key ``j`` when::

    causal        j <= diag
    window left   j >= diag - left     (left = None: unbounded)
    window right  j <= diag + right    (right = None: unbounded)
"""

from __future__ import annotations


def band_visible(diag, k_pos, *, causal: bool, left: int | None, right: int | None, visible=None):
    """Boolean array: keys ``k_pos`` that queries at diagonal positions ``diag`` see.

    ``diag`` and ``k_pos`` are integer arrays of any framework that broadcast against each other
    (e.g. [bq, 1] and [1, bk]). ``visible``, when given, is and-ed in (e.g. a length mask); the
    result is ``visible`` itself (or ``None``) when causal and both window sides are unset.
    """
    if causal:
        visible = _both(visible, k_pos <= diag)
    if left is not None:
        visible = _both(visible, k_pos >= diag - left)
    if right is not None:
        visible = _both(visible, k_pos <= diag + right)
    return visible


def _both(a, b):
    return b if a is None else a & b
