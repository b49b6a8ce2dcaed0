"""Axis bookkeeping through layout-only ops (transpose, broadcast, size-1 reshapes, casts).

Every helper answers one question: for each dimension of a variable, which dimension of an upstream
source it shows, or ``None`` when the variable is constant along it (broadcast).
"""

from __future__ import annotations

from flashport.fusion.graph import IDENTITY_OPS, Graph


def shape(v) -> tuple[int, ...]:
    """Static shape of a variable or literal."""
    return tuple(getattr(v.aval, "shape", ()))


def operand_dims(y, out_shape) -> list:
    """Dims of operand ``y`` of an elementwise op with output ``out_shape`` (size-1 dims broadcast)."""
    ys = shape(y)
    if len(ys) != len(out_shape):
        return [None] * len(out_shape)
    return [None if ys[i] == 1 and out_shape[i] != 1 else i for i in range(len(ys))]


def peel_broadcast(g: Graph, v, dims=None, *, casts=True):
    """Walk up from ``v`` through broadcasts, size-1 reshapes, transposes and (optionally) casts.

    Returns ``(src, dims, eqns)``: ``dims[i]`` is the dim of ``src`` that dim ``i`` of ``v`` shows (or
    None where ``v`` is a broadcast), and ``eqns`` the equations walked through.
    """
    dims = list(range(len(shape(v)))) if dims is None else list(dims)
    eqns = []
    cur = v
    while True:
        e = g.prod(cur)
        if e is None:
            break
        name = e.primitive.name
        if name in IDENTITY_OPS and (casts or name != "convert_element_type"):
            nxt = e.invars[0]
        elif name == "transpose":
            perm = e.params["permutation"]
            dims = [None if d is None else perm[d] for d in dims]
            nxt = e.invars[0]
        elif name == "broadcast_in_dim":
            nxt = e.invars[0]
            xs, os_ = shape(nxt), shape(cur)
            inv = {int(b): j for j, b in enumerate(e.params["broadcast_dimensions"])}
            dims = [None if d is None or d not in inv or xs[inv[d]] != os_[d] else inv[d] for d in dims]
        elif name in ("reshape", "squeeze", "expand_dims"):
            nxt = e.invars[0]
            mapping = unit_reshape_map(shape(nxt), shape(cur))
            if mapping is None:
                break
            dims = [None if d is None else mapping[d] for d in dims]
        else:
            break
        eqns.append(e)
        cur = nxt
    return cur, dims, eqns


def peel_transpose(g: Graph, v):
    """Walk up through transposes and copies only (value-preserving): ``(src, dims, eqns)``."""
    dims = list(range(len(shape(v))))
    eqns = []
    cur = v
    while (e := g.prod(cur)) is not None and e.primitive.name in ("transpose", "copy", "copy_p"):
        if e.primitive.name == "transpose":
            perm = e.params["permutation"]
            dims = [perm[d] for d in dims]
        eqns.append(e)
        cur = e.invars[0]
    return cur, dims, eqns


def unit_reshape_map(in_shape, out_shape):
    """For a reshape that only adds/removes size-1 dims: out dim -> in dim (None for new 1s)."""
    big_in = [i for i, s in enumerate(in_shape) if s != 1]
    big_out = [i for i, s in enumerate(out_shape) if s != 1]
    if [in_shape[i] for i in big_in] != [out_shape[i] for i in big_out]:
        return None
    mapping = [None] * len(out_shape)
    for i_out, i_in in zip(big_out, big_in, strict=False):
        mapping[i_out] = i_in
    return mapping
