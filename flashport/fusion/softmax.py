"""Recognize a row softmax around one ``exp`` equation.

Accepted forms (those ``jax.nn.softmax``, its custom_jvp body, hand-written code and log-softmax produce):

* ``exp(t - max(t))`` normalized by ``/ sum`` or ``* (1 / sum)`` of the same exp, with casts around the
  sum (bf16 softmax) and ``where(m, ·, 0)`` zero-masks (``softmax(where=)``);
* ``exp(t - logsumexp(t))`` and ``exp(log_softmax(t))``;
* normalization deferred past the P·V product, ``(exp(t - max) @ v) / sum(exp(t - max))``: the
  softmax is then the unnormalized exp and :attr:`Softmax.deferred` holds the row sum; the caller
  (:mod:`.patterns`) checks that the product is divided by exactly that sum.

The max may be taken on a transposed copy of ``t`` (jax.nn.dot_product_attention); axes are compared
on the common untransposed source.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.extend import core as jcore

from flashport.fusion.axes import operand_dims, peel_broadcast, peel_transpose, shape
from flashport.fusion.graph import Graph


class NoMatch(Exception):
    """A candidate that is not (safely) attention; the message is the near-miss reason.

    ``eqn``, when given, is the equation where the failed property was observed (reported with its
    source location).
    """

    def __init__(self, reason: str, *, eqn=None):
        super().__init__(reason)
        self.eqn = eqn


@dataclasses.dataclass
class Softmax:
    """A matched softmax: ``p = softmax(t, axis)``; ``eqns`` are the equations it consists of."""

    t: Any  # a jaxpr Var whose aval is a ShapedArray (jcore.Var types it as any AbstractValue)
    axis: int
    p: jcore.Var
    eqns: list[jcore.JaxprEqn]
    zero_preds: list[
        tuple[Any, bool]
    ]  # (pred var, keep_when_true) of where(m, ·, 0) zero-masks inside the softmax
    deferred: Deferred | None = None  # set when ``p`` is the unnormalized exp (divided after P·V)


@dataclasses.dataclass
class Deferred:
    """The row sum ``z = sum(exp, axis)`` of a softmax normalized after the P·V product."""

    z: Any  # the reduce_sum output
    eqns: list  # the sum and the casts from the exp to it


def match_softmax(g: Graph, exp_eqn) -> Softmax:
    """Match the softmax that ``exp_eqn`` is the exponential of, or raise :class:`NoMatch`."""
    x = exp_eqn.invars[0]
    ex = exp_eqn.outvars[0]
    sub = g.prod(x)
    if sub is None or sub.primitive.name != "sub":
        raise NoMatch("the exp input is not `scores - row max` (no max subtraction)", eqn=exp_eqn)
    a, b = sub.invars
    src, dims, peqns = peel_broadcast(g, b, operand_dims(b, shape(x)))
    reduced = [i for i, d in enumerate(dims) if d is None]
    if len(reduced) != 1:
        raise NoMatch("the value subtracted before exp is not a reduction over exactly one axis")
    axis = reduced[0]
    eqns = [exp_eqn, sub, *peqns]

    lse = _logsumexp(g, src, a, axis)
    if lse is not None:
        eqns += lse
        t = a
        shifted = _shifted_by_max(g, a, axis)
        if shifted is not None:  # log_softmax: t - max was computed first
            t, more = shifted
            eqns += more
        return Softmax(t=t, axis=axis, p=ex, eqns=eqns, zero_preds=[])

    red, meqns = _max_chain(g, src)
    if red is None:
        raise NoMatch("the value subtracted before exp is not the row max of the scores")
    eqns += meqns
    if not _same_axis(g, red.invars[0], red.params["axes"], a, axis):
        raise NoMatch("the max is not taken over the same tensor and axis as the subtraction")
    try:
        p, neqns, zero_preds = _normalizer(g, ex, axis)
    except NoMatch:
        deferred = _deferred_sum(g, ex, axis)
        if deferred is None:
            raise
        return Softmax(t=a, axis=axis, p=ex, eqns=eqns, zero_preds=[], deferred=deferred)
    eqns += neqns
    return Softmax(t=a, axis=axis, p=p, eqns=eqns, zero_preds=zero_preds)


def _deferred_sum(g: Graph, ex, axis):
    """The row sum of ``ex`` over ``axis`` (through casts only) when nothing normalizes ``ex`` itself."""
    for v, (eqns, preds) in _derived(g, ex).items():
        if preds:
            continue
        for u in g.users.get(v, ()):
            if u.primitive.name == "reduce_sum" and tuple(u.params["axes"]) == (axis,):
                return Deferred(z=u.outvars[0], eqns=[*eqns, u])
    return None


def reciprocal_of(g: Graph, v):
    """If ``v`` is ``1 / w`` (``div(1, w)`` or ``integer_pow(w, -1)``), return ``(w, eqn)``, else None."""
    e = g.prod(v)
    if e is None:
        return None
    if e.primitive.name == "div" and g.scalar(e.invars[0]) == 1.0:
        return e.invars[1], e
    if e.primitive.name == "integer_pow" and e.params.get("y") == -1:
        return e.invars[0], e
    return None


def _same_axis(g: Graph, y, axes, a, axis) -> bool:
    if len(axes) != 1:
        return False
    ry, dy, _ = peel_transpose(g, y)
    ra, da, _ = peel_transpose(g, a)
    return g.key(ry) == g.key(ra) and dy[int(axes[0])] == da[axis]


def _max_chain(g: Graph, v):
    """Walk up ``max(-inf, ·)``, ``select_n(is_finite)``, casts and stop_gradient to a reduce_max."""
    eqns: list[jcore.JaxprEqn] = []
    while (e := g.prod(v)) is not None:
        name = e.primitive.name
        if name == "reduce_max":
            return e, eqns + [e]
        if name in (
            "stop_gradient",
            "convert_element_type",
            "copy",
            "broadcast_in_dim",
            "transpose",
            "reshape",
        ):
            v = e.invars[0]
        elif name == "max":
            lits = [g.scalar(x) for x in e.invars]
            if lits[0] is not None and lits[0] == -np.inf:
                v = e.invars[1]
            elif lits[1] is not None and lits[1] == -np.inf:
                v = e.invars[0]
            else:
                break
        elif name == "select_n" and len(e.invars) == 3:  # select(is_finite(m), m, 0) from logsumexp
            pred, zero, m = e.invars
            pe = g.prod(pred)
            if pe is None or pe.primitive.name != "is_finite" or g.scalar(zero) != 0.0:
                break
            eqns.append(pe)
            v = m
        else:
            break
        eqns.append(e)
    return None, eqns


def _logsumexp(g: Graph, src, a, axis):
    """If ``src`` is logsumexp of ``a`` (jax.nn.logsumexp or the log_softmax normalizer), its eqns."""
    e = g.prod(src)
    eqns = []
    if e is not None and e.primitive.name == "add":
        parts = [g.prod(x) for x in e.invars]
        logs = [i for i, pe in enumerate(parts) if pe is not None and pe.primitive.name == "log"]
        if len(logs) != 1:
            return None
        red, meqns = _max_chain(g, e.invars[1 - logs[0]])
        if red is None:
            return None
        eqns += [e, *meqns]
        e = parts[logs[0]]
    if e is None or e.primitive.name != "log":
        return None
    eqns.append(e)
    v = e.invars[0]
    while (pe := g.prod(v)) is not None and pe.primitive.name in (
        "abs",
        "convert_element_type",
        "broadcast_in_dim",
        "reshape",
    ):
        eqns.append(pe)
        v = pe.invars[0]
    rs = g.prod(v)
    if rs is None or rs.primitive.name != "reduce_sum" or len(rs.params["axes"]) != 1:
        return None
    eqns.append(rs)
    inner = g.prod(rs.invars[0])
    if inner is None or inner.primitive.name != "exp":
        return None
    eqns.append(inner)
    y = inner.invars[0]
    if _same_axis(g, y, rs.params["axes"], a, axis):  # log_softmax: exp(shifted) summed
        return eqns
    shifted = _shifted_by_max(g, y, int(rs.params["axes"][0]))
    if shifted is None:
        return None
    y0, more = shifted
    if not _same_axis(g, y0, rs.params["axes"], a, axis):
        return None
    return eqns + more


def _shifted_by_max(g: Graph, v, axis):
    """If ``v = t - bcast(max(t, axis))``, return ``(t, eqns)``."""
    e = g.prod(v)
    if e is None or e.primitive.name != "sub":
        return None
    t, b = e.invars
    src, _dims, peqns = peel_broadcast(g, b, operand_dims(b, shape(v)))
    red, meqns = _max_chain(g, src)
    if red is None or not _same_axis(g, red.invars[0], red.params["axes"], t, axis):
        return None
    return t, [e, *peqns, *meqns]


def _derived(g: Graph, ex):
    """Vars that carry ``ex`` through casts and ``where(m, ·, 0)``: var -> (eqns, zero_preds)."""
    # var -> (the eqns from ex to it, the (predicate atom, keep) pairs of the where(m, ., 0) on the way)
    out: dict[jcore.Var, tuple[list[jcore.JaxprEqn], list[tuple[Any, bool]]]] = {ex: ([], [])}
    frontier = [ex]
    while frontier:
        v = frontier.pop()
        eqns, preds = out[v]
        for u in g.users.get(v, ()):
            name = u.primitive.name
            if name in ("convert_element_type", "copy"):
                pass
            elif (
                name == "select_n"
                and len(u.invars) == 3
                and u.invars[2] is v
                and g.scalar(u.invars[1]) == 0.0
            ):
                preds = preds + [(u.invars[0], True)]
            else:
                continue
            w = u.outvars[0]
            if w not in out:
                out[w] = (eqns + [u], preds if name == "select_n" else list(preds))
                frontier.append(w)
    return out


def _normalizer(g: Graph, ex, axis):
    """Find ``p = e / sum(e)`` (or ``e * (1/sum(e))``) over ``axis`` downstream of ``ex``."""
    derived = _derived(g, ex)
    for v, (eqns, preds) in derived.items():
        for u in g.users.get(v, ()):
            name = u.primitive.name
            if name not in ("div", "mul") or len(u.invars) != 2:
                continue
            num_pos = 0 if u.invars[0] is v else 1
            if name == "div" and num_pos != 0:
                continue
            other = u.invars[1 - num_pos]
            src, dims, beqns = peel_broadcast(g, other, operand_dims(other, shape(u.outvars[0])))
            if [i for i, d in enumerate(dims) if d is None] != [axis]:
                continue
            recip = []
            if name == "mul":  # e * (1 / z)
                r = reciprocal_of(g, src)
                if r is None:
                    continue
                recip = [r[1]]
                src, _, more = peel_broadcast(g, r[0])
                recip += more
            rs = g.prod(src)
            if rs is None or rs.primitive.name != "reduce_sum" or tuple(rs.params["axes"]) != (axis,):
                continue
            if rs.invars[0] not in derived:
                continue
            seqns, spreds = derived[rs.invars[0]]
            zero_preds = preds + spreds
            return u.outvars[0], [*eqns, u, *beqns, *recip, rs, *seqns], zero_preds
    for v in derived:
        for u in g.users.get(v, ()):
            if u.primitive.name == "reduce_sum" and tuple(u.params["axes"]) != (axis,):
                raise NoMatch("the max and the sum of the softmax run over different axes")
    raise NoMatch("exp(scores - max) is not normalized by its own sum over the same axis")
