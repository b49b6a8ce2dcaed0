"""The probabilities path of an attention site: from the softmax output down to the PV ``dot_general``.

:func:`walk_down` follows the probabilities through casts, transposes, size-1 reshapes, all-ones
products (transformers' default head mask), zero-masks (``where(m, p, 0)``, which must repeat a
pre-softmax mask) and attention-weight dropout (:mod:`.dropout`) to the product that contracts the
key axis; :func:`pv_roles` assigns the roles of that product's operands and output dims;
:func:`deferred_division` checks a softmax normalized after the product.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from flashport.fusion.axes import operand_dims, peel_broadcast, shape
from flashport.fusion.dropout import DropoutWalk
from flashport.fusion.graph import Graph
from flashport.fusion.scores import CASTS, unit_map
from flashport.fusion.softmax import NoMatch, Softmax, reciprocal_of


class ProbPath(NamedTuple):
    """The walk from the softmax output to the PV product."""

    pv: Any  # the PV dot_general
    p: Any  # the probabilities as the PV product reads them
    pdims: list  # QK-output dim shown by each dim of ``p``
    zero_preds: list  # (pred, keep_when_true, var, dims) of post-softmax zero-masks
    eqns: list  # equations walked through (the PV product included)
    dropout: Any  # a .dropout.Dropout, or None


class PVRoles(NamedTuple):
    """The value operand of the PV product and the role of each of the product's output dims."""

    v: Any
    vc: int  # v's contracted (key) dim
    v_batch: dict  # QK-output batch dim -> v dim
    vfree: int  # v's head_dim
    roles: list  # per output dim: ("d", QK-output dim) or ("dv",)


def walk_down(g: Graph, sm: Softmax, t_dims) -> ProbPath:
    """Follow the probabilities ``sm.p`` to the PV product; raise :class:`NoMatch` on anything else."""
    zero_preds = [(pred, keep, sm.p, list(t_dims)) for pred, keep in sm.zero_preds]
    sum_path = {id(e) for e in sm.deferred.eqns} if sm.deferred is not None else set()
    cur, pdims, eqns, drop = sm.p, list(t_dims), [], DropoutWalk(g)
    while True:
        u = _single_user(g, cur, sum_path)
        eqns.append(u)
        name = u.primitive.name
        if name == "dot_general":
            if any(u.params["dimension_numbers"][0]):
                break  # a contraction: the PV product
            pdims = _unit_product(g, u, cur, pdims)
        elif drop.step(u, cur):
            pass
        elif name == "mul" and shape(u.outvars[0]) == shape(cur) and _all_ones(g, other_operand(u, cur)):
            pass
        elif name in CASTS:
            pass
        elif name == "transpose":
            pdims = [pdims[p] for p in u.params["permutation"]]
        elif (mapping := unit_map(u)) is not None:
            pdims = [None if m is None else pdims[m] for m in mapping]
        elif (
            name == "select_n" and len(u.invars) == 3 and u.invars[2] is cur and g.scalar(u.invars[1]) == 0.0
        ):
            zero_preds.append((u.invars[0], True, cur, list(pdims)))
        elif name in ("mul", "div"):
            raise NoMatch(
                "the probabilities are multiplied by a tensor or rescaled (not a recognized dropout, or "
                "a post-softmax mask without renormalisation)",
                eqn=u,
            )
        else:
            raise NoMatch(f"`{name}` between the softmax and the PV product", eqn=u)
        cur = u.outvars[0]
    if None in pdims:
        raise NoMatch("size-1 dims of the probabilities reach the PV product", eqn=u)
    return ProbPath(pv=u, p=cur, pdims=pdims, zero_preds=zero_preds, eqns=eqns, dropout=drop.finish(u))


def _single_user(g: Graph, cur, sum_path):
    """The one equation that reads the probabilities ``cur`` (the softmax sum aside)."""
    if cur in g.outvars:
        raise NoMatch(
            "the attention probabilities have other users: they are returned (attention maps "
            "are an output, so the scores must be materialized)",
            eqn=g.prod(cur),
        )
    users = [u for u in g.users.get(cur, ()) if id(u) not in sum_path]
    if len(users) > 1:
        raise NoMatch(
            "the attention probabilities have other users (returned, reused or dropped out)", eqn=users[1]
        )
    if not users:
        raise NoMatch("the attention probabilities are not used (no PV product)", eqn=g.prod(cur))
    return users[0]


def pv_roles(path: ProbPath, s_dot: int, nb: int, qfree_out) -> PVRoles:
    """Check the PV product contracts the key axis and keeps the batch and query dims; assign roles."""
    pv, cur, pdims = path.pv, path.p, path.pdims
    (plc, prc), (plb, prb) = pv.params["dimension_numbers"]
    if pv.invars[0] is cur and pv.invars[1] is cur:
        raise NoMatch("the probabilities are multiplied by themselves", eqn=pv)
    p_is_lhs = pv.invars[0] is cur
    v = pv.invars[1] if p_is_lhs else pv.invars[0]
    pc, vc = (plc, prc) if p_is_lhs else (prc, plc)
    pb, vb = (plb, prb) if p_is_lhs else (prb, plb)
    if len(pc) != 1 or pdims[pc[0]] != s_dot:
        raise NoMatch("the PV product does not contract the softmax (key) axis", eqn=pv)
    v_batch = {}
    for pi, vi in zip(pb, vb, strict=True):
        if pdims[pi] >= nb:
            raise NoMatch("the PV product batches over a non-batch dim of the scores", eqn=pv)
        v_batch[pdims[pi]] = vi
    if sorted(v_batch) != list(range(nb)):
        raise NoMatch("the PV product does not keep every batch dim of the QK product", eqn=pv)
    p_free_dims = [d for d in range(len(pdims)) if d not in pc and d not in pb]
    if sorted(pdims[d] for d in p_free_dims) != sorted(qfree_out):
        raise NoMatch("the PV product's free dims are not the query dims", eqn=pv)
    vfree = [d for d in range(len(shape(v))) if d not in vc and d not in vb]
    if len(vfree) != 1:
        raise NoMatch(
            f"the value side of the PV product has {len(vfree)} free dims (expected head_dim)", eqn=pv
        )
    roles: list[tuple] = [("d", pdims[pi]) for pi in pb]
    free_roles: list[tuple] = [("d", pdims[d]) for d in p_free_dims]
    roles += (free_roles + [("dv",)]) if p_is_lhs else ([("dv",)] + free_roles)
    return PVRoles(v=v, vc=vc[0], v_batch=v_batch, vfree=vfree[0], roles=roles)


def other_operand(eqn, x):
    """The operand of the binary ``eqn`` that is not ``x``."""
    a, b = eqn.invars
    return b if a is x else a


def _all_ones(g: Graph, x) -> bool:
    val = g.const_value(x)
    return val is not None and val.size > 0 and bool(np.all(val == 1))


def _unit_product(g: Graph, u, p, pdims):
    """Dims after a contraction-free ``dot_general`` of the probabilities ``p`` with an all-ones tensor.

    transformers' Flax attention always applies its head mask as ``einsum("...hqk,h->...hqk")``, with
    ones when the caller gives none: an identity on the probabilities, so the PV product is further down.
    """
    (_, _), (lb, rb) = u.params["dimension_numbers"]
    if u.invars[0] is u.invars[1]:
        raise NoMatch("the probabilities are multiplied by themselves", eqn=u)
    p_is_lhs = u.invars[0] is p
    other = other_operand(u, p)
    pb, ob = (lb, rb) if p_is_lhs else (rb, lb)
    if len(ob) != len(shape(other)):
        raise NoMatch(
            "the probabilities are multiplied by a tensor in an outer product (no PV contraction)", eqn=u
        )
    if not _all_ones(g, other):
        raise NoMatch(
            "the probabilities are multiplied by a per-head or per-row tensor (e.g. a head mask) "
            "that is not all ones",
            eqn=u,
        )
    return [pdims[i] for i in pb] + [pdims[d] for d in range(len(pdims)) if d not in pb]


# ----------------------------------------------------------------------------- deferred normalization


def deferred_division(g: Graph, pv, roles, z, t_dims, axis):
    """``pv`` of an unnormalized exp must be divided by its row sum ``z``: ``(div eqn, eqns, roles)``.

    Transposes and casts of the product may come first; ``roles`` are the division output's dim roles.

    Accepted: ``pv / bcast(z)``, ``pv * bcast(1 / z)`` and ``pv * bcast(z ** -1)``, where each element
    of the product is divided by the sum of the row (batch and query indices) it came from.
    """
    u, o, roles, eqns = _past_layout_ops(g, pv, roles)
    name = u.primitive.name
    if name not in ("div", "mul") or (name == "div" and u.invars[0] is not o) or u.invars[0] is u.invars[1]:
        raise NoMatch(
            f"the PV product of the unnormalized exp is followed by `{name}`, not a division by "
            "the softmax sum",
            eqn=u,
        )
    if shape(u.outvars[0]) != shape(o):
        raise NoMatch("the division after the PV product broadcasts the product", eqn=u)
    src, dims, more = _divisor_source(g, u, o)
    if src is not z:
        raise NoMatch(
            "the PV product of the unnormalized exp is divided by something other than the sum of that exp",
            eqn=u,
        )
    _check_rows(u, o, roles, dims, [d for i, d in enumerate(t_dims) if i != axis])
    return u, eqns + more, roles


def _past_layout_ops(g: Graph, pv, roles):
    """Follow the product through transposes and casts: ``(next eqn, its input, roles, eqns)``."""
    o, roles, eqns = pv.outvars[0], list(roles), list[Any]()
    u = pv  # the equation that produced ``o``: named in the reason when ``o`` has other users
    while True:
        users = g.users.get(o, ())
        if o in g.outvars or len(users) != 1:
            raise NoMatch(
                "softmax normalized after the PV product, but the unnormalized product has other users", eqn=u
            )
        u = users[0]
        if u.primitive.name == "transpose":
            roles = [roles[p] for p in u.params["permutation"]]
        elif u.primitive.name not in CASTS:
            return u, o, roles, eqns
        eqns.append(u)
        o = u.outvars[0]


def _divisor_source(g: Graph, u, o):
    """What ``o`` is divided by in ``u``: ``(source, dims of the operand in it, eqns walked)``."""
    other = other_operand(u, o)
    src, dims, eqns = peel_broadcast(g, other, operand_dims(other, shape(o)))
    if u.primitive.name == "mul":
        r = reciprocal_of(g, src)
        if r is None:
            raise NoMatch(
                "the PV product of the unnormalized exp is multiplied by something other than "
                "the reciprocal of the softmax sum",
                eqn=u,
            )
        src, dims2, more = peel_broadcast(g, r[0])
        dims = [None if d is None else dims2[d] for d in dims]
        eqns = [*eqns, r[1], *more]
    return src, dims, eqns


def _check_rows(u, o, roles, dims, zdims):
    """Each element of the product is divided by the sum of its own row."""
    for i, role in enumerate(roles):
        if role == ("dv",):
            ok = dims[i] is None
        elif dims[i] is None:
            ok = shape(o)[i] == 1
        else:
            ok = zdims[dims[i]] == role[1]
        if not ok:
            raise NoMatch(
                "the PV product is divided by the softmax sum of other rows (misaligned axes)", eqn=u
            )
