"""Trace-time evaluation of small constant subgraphs in numpy (no XLA compilation).

Masks built from ``iota`` comparisons, scale literals such as ``sqrt(8.0)`` and fills are folded
here; an unknown primitive simply makes the value non-constant.
"""

from __future__ import annotations

import numpy as np


def _bcast(params, x):
    shape, dims = params["shape"], params["broadcast_dimensions"]
    expanded = [1] * len(shape)
    for i, d in enumerate(dims):
        expanded[int(d)] = x.shape[i]
    return np.broadcast_to(x.reshape(expanded), shape)


def _select_n(params, pred, *cases):
    if pred.dtype == bool:
        return np.where(pred, cases[1], cases[0]) if len(cases) == 2 else None
    return np.choose(pred.astype(np.int64), np.broadcast_arrays(*cases))


def _convert(params, x):
    return x.astype(np.dtype(params["new_dtype"]))


def _iota(params):
    shape, dim = params["shape"], params["dimension"]
    ar = np.arange(shape[dim], dtype=np.dtype(params["dtype"]))
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return np.broadcast_to(ar.reshape(view), shape)


def _slice(params, x):
    start, limit, strides = params["start_indices"], params["limit_indices"], params["strides"]
    strides = strides or (1,) * len(start)
    return x[tuple(slice(a, b, s) for a, b, s in zip(start, limit, strides, strict=False))]


def _same(fn):
    def apply(params, *xs):
        out = fn(*xs)
        return np.asarray(out).astype(np.result_type(*xs)) if xs else out

    return apply


OPS = {
    "iota": _iota,
    "broadcast_in_dim": _bcast,
    "convert_element_type": _convert,
    "reshape": lambda p, x: x.reshape(p["new_sizes"]),
    "squeeze": lambda p, x: np.squeeze(x, axis=tuple(p["dimensions"])),
    "expand_dims": lambda p, x: np.expand_dims(x, tuple(p["dimensions"])),
    "transpose": lambda p, x: np.transpose(x, p["permutation"]),
    "slice": _slice,
    "copy": lambda p, x: x,
    "copy_p": lambda p, x: x,
    "stop_gradient": lambda p, x: x,
    "select_n": _select_n,
    "add": _same(np.add),
    "sub": _same(np.subtract),
    "mul": _same(np.multiply),
    "div": lambda p, a, b: (a // b if np.issubdtype(a.dtype, np.integer) else a / b).astype(
        np.result_type(a, b)
    ),
    "max": _same(np.maximum),
    "min": _same(np.minimum),
    "neg": _same(np.negative),
    "abs": _same(np.abs),
    "sqrt": _same(np.sqrt),
    "rsqrt": _same(lambda x: 1 / np.sqrt(x)),
    "exp": _same(np.exp),
    "log": _same(np.log),
    "integer_pow": lambda p, x: (x ** p["y"]).astype(x.dtype),
    "ge": lambda p, a, b: a >= b,
    "gt": lambda p, a, b: a > b,
    "le": lambda p, a, b: a <= b,
    "lt": lambda p, a, b: a < b,
    "eq": lambda p, a, b: a == b,
    "ne": lambda p, a, b: a != b,
    "and": _same(np.logical_and),
    "or": _same(np.logical_or),
    "not": lambda p, x: ~x if x.dtype == bool else np.invert(x),
    "is_finite": lambda p, x: np.isfinite(x),
    "concatenate": lambda p, *xs: np.concatenate(xs, axis=p["dimension"]),
}


def evaluate(eqn, vals):
    """Value of ``eqn``'s single output on numpy ``vals``, or None when not supported."""
    fn = OPS.get(eqn.primitive.name)
    if fn is None:
        return None
    with np.errstate(all="ignore"):
        out = fn(eqn.params, *vals)
    if out is None:
        return None
    out = np.asarray(out)
    want = eqn.outvars[0].aval
    if tuple(out.shape) != tuple(want.shape):
        return None
    return out.astype(np.dtype(want.dtype), copy=False)
