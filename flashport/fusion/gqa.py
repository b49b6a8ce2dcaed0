"""Fold K/V repeated over heads (``jnp.repeat``, ``broadcast_to`` + reshape, MQA broadcasts) back to GQA.

``flashport.attention`` takes K/V with ``Hkv`` heads and lets query head ``h`` read kv head
``h // (Hq // Hkv)``. A program that repeats K/V itself computes ``k_rep[.., h, ..] = k[.., h // G, ..]``
when the repeat puts the copies *inside* each kv head (``jnp.repeat(k, G, axis=heads)``, or a
broadcast to ``[.., Hkv, G, ..]`` merged by a reshape): exactly the contract's grouping, so the
un-repeated K/V can be passed instead. ``jnp.tile`` and broadcasts to ``[.., G, Hkv, ..]`` read kv head
``h % Hkv``, a different grouping: they are never folded (the site is still fused, with the repeated
K/V as written).
"""

from __future__ import annotations

from flashport.fusion.axes import shape
from flashport.fusion.graph import Graph

_WALK = ("transpose", "copy", "copy_p")  # no casts: the kernel dtype comes from the operands


def fold_repeat(g: Graph, var, order, head_pos, *, scales=False):
    """Undo a head repeat of ``var`` (K or V as the QK/PV product reads it).

    Args:
      g: the graph of the jaxpr ``var`` lives in.
      var: the operand; ``order`` lists its dims in the canonical order, ``order[head_pos]`` is the
        head dim.
      scales: also walk through multiplications/divisions by a constant scalar (for K, whose
        scale can move into the contract's ``scale``), collecting their product.

    Returns:
      ``(src, src_order, hkv, factor)``: the un-repeated source, its dims in canonical order
      (size-1 dims the canonical shape lacks come last), its number of kv heads and the scalar
      factor walked through; or None when ``var`` is not a head repeat with the contract's grouping.
    """
    cur, order, factor = _walk_to_repeat(g, var, order, scales)
    e = g.prod(cur)
    if e is None:
        return None
    found = _repeat_of(g, e, shape(cur), order[head_pos])
    if found is None:
        return None
    bcast, y, to_y, copies, hkv = found
    if bcast is None or bcast.primitive.name != "broadcast_in_dim":
        return None
    x = bcast.invars[0]
    xs = shape(x)
    inv = {int(b): i for i, b in enumerate(bcast.params["broadcast_dimensions"])}
    if copies in inv and xs[inv[copies]] != 1:
        return None  # the "copies" dim is not a broadcast
    for j, size in enumerate(y):
        if j == copies:
            continue
        if (j in inv and xs[inv[j]] != size) or (j not in inv and size != 1):
            return None  # another dim is broadcast too: not a plain head repeat
    src_order = [inv[to_y[d]] for d in order if to_y[d] in inv and to_y[d] != copies]
    src_order += [i for i in range(len(xs)) if i not in src_order]
    return x, tuple(src_order), hkv, factor


def _walk_to_repeat(g: Graph, var, order, scales):
    """Walk up through transposes, copies (and constant scalings): ``(var, its canonical order, factor)``."""
    cur, order, factor = var, list(order), 1.0
    while (e := g.prod(cur)) is not None:
        if e.primitive.name == "transpose":
            order = [e.params["permutation"][d] for d in order]
        elif scales and (s := _scalar_factor(g, e, cur)) is not None:
            factor *= s[0]
            cur = s[1]
            continue
        elif e.primitive.name not in _WALK:
            break
        cur = e.invars[0]
    return cur, order, factor


def _repeat_of(g: Graph, e, out, hd):
    """The broadcast behind a head repeat ``e`` (output shape ``out``, head dim ``hd``), or None.

    Returns ``(broadcast eqn, its output shape, out dim -> broadcast dim, the copies dim, Hkv)``:
    a reshape merging ``[.., Hkv, G, ..]`` into the head dim, or (MQA) a broadcast of one kv head.
    """
    if e.primitive.name == "reshape" and e.params.get("dimensions") is None:
        y = shape(e.invars[0])
        if (
            len(y) != len(out) + 1
            or y[:hd] != out[:hd]
            or y[hd + 2 :] != out[hd + 1 :]
            or y[hd] * y[hd + 1] != out[hd]
            or y[hd + 1] == 1
        ):
            return None
        to_y = [d if d <= hd else d + 1 for d in range(len(out))]  # cur dim -> y dim (head -> Hkv)
        return g.prod(e.invars[0]), y, to_y, hd + 1, y[hd]
    if e.primitive.name == "broadcast_in_dim":  # MQA: one kv head broadcast to every query head
        if out[hd] == 1:
            return None
        return e, out, list(range(len(out))), hd, 1
    return None


def _scalar_factor(g: Graph, e, out):
    """``(c, x)`` when ``e`` computes ``out = x * c`` or ``x / c`` for a nonzero constant scalar ``c``."""
    if e.primitive.name not in ("mul", "div"):
        return None
    a, b = e.invars
    for x, c in ((a, b), (b, a)) if e.primitive.name == "mul" else ((a, b),):
        s = g.scalar(c)
        if s and shape(x) == shape(out) and x.aval.dtype == out.aval.dtype:
            return (s if e.primitive.name == "mul" else 1.0 / s), x
    return None
