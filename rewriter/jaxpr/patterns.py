"""Match ``softmax(Q·Kᵀ)·V`` in one normalized jaxpr, semantically rather than by templates.

Matching starts at every ``exp`` (the one op every softmax spelling shares): the softmax around it,
then the scores path up to the QK ``dot_general`` (scale, softcap, bias, masks, casts, transposes,
with axes tracked), then the probabilities down to the PV ``dot_general``. q, k and v roles come from
the dimension numbers: the softmax axis is k's only free dim, and the PV product must contract it
against v's sequence dim. Everything between the two products must be explained and have no other
users (the escape rule), otherwise the candidate is reported as a near-miss with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from flashport.rewriter.jaxpr import positional
from flashport.rewriter.jaxpr.axes import operand_dims, peel_broadcast, shape, unit_reshape_map
from flashport.rewriter.jaxpr.canon import is_key_padding
from flashport.rewriter.jaxpr.gqa import fold_repeat
from flashport.rewriter.jaxpr.graph import Graph, location
from flashport.rewriter.jaxpr.softmax import NoMatch, match_softmax

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# A mask fill at or below this (in the softmax dtype) zeroes its probability for any sane score.
MIN_FILL = -1e4


@dataclasses.dataclass
class Term:
    """A bias or mask operand: ``var``'s dims map to QK-output dims (None = size-1/broadcast)."""

    var: object
    dmap: tuple
    mult: float = 1.0  # bias multiplier (scales applied after the add)
    keep_when_true: bool = True  # mask polarity
    fill: float = -np.inf  # mask fill (after later scalings)


@dataclasses.dataclass
class Match:
    """Everything the emitter needs to replace one attention site (see :mod:`.emit`)."""

    anchor: object  # the PV dot_general equation whose output is replaced
    q: object
    k: object
    v: object
    q_order: tuple
    k_order: tuple
    v_order: tuple
    sizes: dict  # B_parts, H (or None), G_parts, T, S, D, Dv
    out_perm: tuple
    canon_dims: list  # QK-output dims in canonical bias/mask order [rest..., H?, G..., T, S]
    groups: list  # canonical positions merged into B, Hq, T, S
    scale: float
    softcap: float | None
    biases: list
    masks: list
    causal: bool
    window: tuple | None
    align: str
    empty: str | None  # what the original returns on a fully masked row: "zero", "mean", "nan"
    dtype: str
    out_dtype: object
    info: dict

    @property
    def inputs(self):
        """Variables the replacement reads (for liveness)."""
        return [self.q, self.k, self.v, *(t.var for t in self.biases), *(t.var for t in self.masks)]


@dataclasses.dataclass
class Miss:
    """A near-miss: an exp that looked like attention but was not fused, and why."""

    eqn: object
    reason: str
    info: dict


def find_matches(g: Graph):
    """Return ``(matches, misses)`` for every attention-like ``exp`` in ``g``."""
    matches, misses, used = [], [], set()
    for eqn in g.jaxpr.eqns:
        if eqn.primitive.name != "exp":
            continue
        try:
            m = match_at(g, eqn)
        except NoMatch as err:
            info = _candidate_info(g, eqn)
            if info is not None:
                misses.append(Miss(eqn=eqn, reason=_with_place(err), info=info))
            continue
        except Exception as err:  # noqa: BLE001 -- a matcher bug must never break the user's program
            misses.append(internal_miss(g, eqn, "matching", err))
            continue
        if id(m.anchor) in used:
            continue
        used.add(id(m.anchor))
        matches.append(m)
    # an inner exp (logsumexp) of a matched site is not a near-miss
    covered = {id(e) for m in matches for e in m.info.pop("_eqns")}
    misses = [x for x in misses if id(x.eqn) not in covered]
    return matches, misses


def _with_place(err: NoMatch) -> str:
    """The near-miss reason, naming the equation where the first failed property was seen."""
    if err.eqn is None:
        return str(err)
    return f"{err} [at `{err.eqn.primitive.name}`, {location(err.eqn)}]"


def internal_miss(g: Graph, eqn, stage: str, err: Exception) -> Miss:
    """A near-miss for a site where the pass itself failed: the site is left exactly as written."""
    try:
        info = _candidate_info(g, eqn, require_dots=False)
    except Exception:  # noqa: BLE001 -- reporting is best effort here
        info = {"location": "?", "scores_shape": shape(eqn.invars[0]), "dtype": str(eqn.invars[0].aval.dtype)}
    reason = f"internal error while {stage} (site left unchanged): {type(err).__name__}: {err}"
    return Miss(eqn=eqn, reason=reason, info=info)


def _candidate_info(g: Graph, exp_eqn, require_dots=True):
    """Report info for a failed candidate, or None when the exp is unrelated to any dot_general."""
    up = _reaches(g, exp_eqn.invars[0], "up")
    down = _reaches(g, exp_eqn.outvars[0], "down")
    if require_dots and not (up and down):
        return None
    return {
        "location": location(exp_eqn),
        "scores_shape": shape(exp_eqn.invars[0]),
        "dtype": str(exp_eqn.invars[0].aval.dtype),
    }


def _reaches(g: Graph, v, direction, limit=40):
    seen: set[object] = set()
    frontier = [v]
    while frontier and len(seen) < limit:
        x = frontier.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if direction == "up":
            e = g.prod(x)
            if e is None:
                continue
            if e.primitive.name == "dot_general":
                return True
            frontier += [y for y in e.invars if not hasattr(y, "val")]
        else:
            for u in g.users.get(x, ()):
                if u.primitive.name == "dot_general":
                    return True
                frontier += list(u.outvars)
    return False


# ----------------------------------------------------------------------------- scores path


def _walk_up(g: Graph, c, depth=0):
    """From the softmax input up to the QK product: ``(dot_eqn, stages)``, stages from t upwards."""
    if depth > 64:
        raise NoMatch("scores path too long")
    e = g.prod(c)
    if e is None:
        raise NoMatch("the softmax input is not computed from a dot_general")
    name = e.primitive.name
    ins = e.invars
    if name == "dot_general":
        return e, []
    stage: tuple[str, Any, Any]  # (kind, value, extra): see match_at
    if name in ("convert_element_type", "copy", "copy_p"):
        stage, up = ("cast", None, None), ins[0]
    elif name == "transpose":
        stage, up = ("perm", e.params["permutation"], None), ins[0]
    elif name == "tanh":
        stage, up = ("tanh", None, None), ins[0]
    elif (mapping := _unit_map(e)) is not None:  # size-1 dims added/removed (jnp.matmul with B=1)
        stage, up = ("remap", mapping, None), ins[0]
    elif name == "mul":
        s0, s1 = g.scalar(ins[0]), g.scalar(ins[1])
        if s1 is not None and shape(ins[0]) == shape(c):
            stage, up = ("scale", s1, None), ins[0]
        elif s0 is not None and shape(ins[1]) == shape(c):
            stage, up = ("scale", s0, None), ins[1]
        else:
            raise NoMatch(
                "the scores are multiplied by a non-constant or a tensor (not a scalar scale)", eqn=e
            )
    elif name == "div":
        s1 = g.scalar(ins[1])
        if s1 is None or s1 == 0 or shape(ins[0]) != shape(c):
            raise NoMatch("the scores are divided by a non-constant or a tensor (not a scalar scale)", eqn=e)
        stage, up = ("scale", 1.0 / s1, None), ins[0]
    elif name == "add" and (mul_add := _mul_add_mask(g, e, c)) is not None:
        up, fill, pred, inner = mul_add
        stage = ("mask", (fill, True, inner), pred)
    elif name in ("add", "sub"):
        first_err = None
        for pos in (0, 1) if name == "add" else (0,):
            if shape(ins[pos]) != shape(c):
                continue
            try:
                dot, stages = _walk_up(g, ins[pos], depth + 1)
            except NoMatch as err:
                first_err = first_err or err
                continue
            other = ins[1 - pos]
            sign = -1.0 if name == "sub" else 1.0
            kind = "shift" if g.scalar(other) is not None else "bias"
            return dot, [(kind, sign, (other, e, c))] + stages
        raise first_err or NoMatch(f"`{name}` on the scores with no dot_general above it")
    elif name == "select_n" and len(ins) == 3:
        pred, f, s = ins
        sf, ss = g.scalar(f), g.scalar(s)
        if sf is not None and ss is None:
            stage, up = ("mask", (sf, True), pred), s
        elif ss is not None and sf is None:
            stage, up = ("mask", (ss, False), pred), f
        else:
            raise NoMatch("select between two tensors on the scores (not a mask with a constant fill)", eqn=e)
    else:
        raise NoMatch(f"`{name}` on the scores path is not part of the attention contract", eqn=e)
    dot, stages = _walk_up(g, up, depth + 1)
    return dot, [(stage[0], stage[1], (stage[2], e, c))] + stages


def _mul_add_mask(g: Graph, e, c):
    """``s * m + (1 - m) * fill``, ``m`` a 0/1 float cast of a boolean: ``(s, fill, m, s*m eqn)`` or None.

    For finite scores this equals ``where(m, s, fill)`` exactly (``0 * fill`` is ``-0.0``).
    """
    for a, b in (e.invars, e.invars[::-1]):
        b_src, b_dims, _ = peel_broadcast(g, b, operand_dims(b, shape(c)), casts=False)
        ea, eb = g.prod(a), g.prod(b_src)
        if ea is None or eb is None or ea.primitive.name != "mul" or eb.primitive.name != "mul":
            continue
        for x, m in (ea.invars, ea.invars[::-1]):
            if shape(x) != shape(c) or g.scalar(x) is not None:
                continue
            m_src = _bool_source(g, m, shape(c))
            if m_src is None:
                continue
            for t, f in (eb.invars, eb.invars[::-1]):
                fill = g.scalar(f)
                if fill is None:
                    continue
                if shape(t) != shape(b_src):
                    continue
                one_minus = peel_broadcast(g, t, b_dims, casts=False)
                es = g.prod(one_minus[0])
                if es is None or es.primitive.name != "sub" or g.scalar(es.invars[0]) != 1.0:
                    continue
                sub_dims = one_minus[1]
                inner = peel_broadcast(g, es.invars[1], [d for d in sub_dims], casts=True)
                if (g.key(inner[0]), inner[1]) == (g.key(m_src[0]), m_src[1]):
                    return x, fill, m, ea
    return None


def _bool_source(g: Graph, m, out_shape):
    src, dims, _ = peel_broadcast(g, m, operand_dims(m, out_shape), casts=True)
    if np.dtype(src.aval.dtype) != np.bool_ or np.dtype(m.aval.dtype) == np.bool_:
        return None
    return src, dims


def _unit_map(e):
    """For a reshape/squeeze/expand_dims/broadcast that only adds or drops size-1 dims: out -> in."""
    name = e.primitive.name
    if name not in ("reshape", "squeeze", "expand_dims", "broadcast_in_dim"):
        return None
    src, out = shape(e.invars[0]), shape(e.outvars[0])
    if math.prod(src) != math.prod(out):
        return None
    if name == "broadcast_in_dim" and list(e.params["broadcast_dimensions"]) != sorted(
        e.params["broadcast_dimensions"]
    ):
        return None
    return unit_reshape_map(src, out)


def _term(g: Graph, y, out_var, out_dims, mask=False):
    """Bias/mask operand ``y`` of an op whose output ``out_var`` has QK dims ``out_dims``.

    For a mask, a float cast of a boolean (the multiply-add form) is traced back to the boolean.
    """
    bool_src = _bool_source(g, y, shape(out_var)) if mask else None
    if bool_src is not None:
        src, dims = bool_src
    else:
        src, dims, _ = peel_broadcast(g, y, operand_dims(y, shape(out_var)), casts=False)
    dmap = [None] * len(shape(src))
    for i, d in enumerate(dims):
        if d is not None:
            dmap[d] = out_dims[i]
    for j, size in enumerate(shape(src)):
        if dmap[j] is None and size != 1:
            raise NoMatch("a mask/bias dimension could not be aligned with the scores")
    return src, tuple(dmap)


def _algebra(g: Graph, stages, t_dtype):
    """Fold the stages (dot -> softmax input) into contract terms; also each stage output's dims."""
    alpha, beta, tanh = 1.0, 1.0, False
    biases: list[Term] = []
    masks: list[Term] = []
    for kind, val, (extra, _eqn, out_var, out_dims) in stages:
        if kind == "scale":
            if tanh:
                if biases or masks:
                    raise NoMatch("scores scaled after softcap and bias/mask (not the contract order)")
                beta *= val
            else:
                alpha *= val
                for b in biases:
                    b.mult *= val
                for m in masks:
                    if val <= 0:
                        raise NoMatch("masked scores multiplied by a non-positive constant")
                    m.fill *= val
        elif kind == "tanh":
            if tanh or biases or masks:
                raise NoMatch("tanh applied after bias/mask (softcap must come before them)")
            tanh = True
        elif kind == "bias":
            src, dmap = _term(g, extra, out_var, out_dims)
            biases.append(Term(var=src, dmap=dmap, mult=val))
        elif kind == "mask":
            fill, keep = val[:2]
            src, dmap = _term(g, extra, out_var, out_dims, mask=True)
            masks.append(Term(var=src, dmap=dmap, keep_when_true=keep, fill=fill))
    if tanh and beta <= 0:
        raise NoMatch("tanh on the scores is not a softcap (non-positive cap)")
    for m in masks:
        fill = float(np.asarray(m.fill, dtype=t_dtype))
        if not fill <= MIN_FILL:
            raise NoMatch(f"mask fill {m.fill:g} is not negative enough to zero a probability in {t_dtype}")
    return (alpha * beta if tanh else alpha), (beta if tanh else None), biases, masks


# ----------------------------------------------------------------------------- the whole site


def match_at(g: Graph, exp_eqn) -> Match:
    """Match the attention site around ``exp_eqn`` or raise :class:`NoMatch` with the reason."""
    sm = match_softmax(g, exp_eqn)
    dot, stages = _walk_up(g, sm.t)
    explained = {id(e) for e in sm.eqns} | {id(dot)}
    # dims of every stage output, from the dot downwards
    dims: list[Any] = list(range(len(shape(dot.outvars[0]))))
    annotated = []
    for kind, val, (extra, eqn, out_var) in reversed(stages):
        if kind == "perm":
            dims = [dims[p] for p in val]
        elif kind == "remap":
            dims = [None if m is None else dims[m] for m in val]
        annotated.append((kind, val, (extra, eqn, out_var, list(dims))))
        explained.add(id(eqn))
        if kind == "mask" and len(val) > 2:  # the multiply-add form's `s * m`
            explained.add(id(val[2]))
    t_dims = dims
    t_dtype = np.dtype(sm.t.aval.dtype)
    s_dot = t_dims[sm.axis]

    # ---- QK roles
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    lhs, rhs = dot.invars
    nb = len(lb)
    lfree = [d for d in range(len(shape(lhs))) if d not in lc and d not in lb]
    rfree = [d for d in range(len(shape(rhs))) if d not in rc and d not in rb]
    if s_dot < nb:
        raise NoMatch("the softmax runs over a batch dim of the QK product", eqn=dot)
    k_is_lhs = s_dot < nb + len(lfree)
    q, k = (rhs, lhs) if k_is_lhs else (lhs, rhs)
    qc, kc = (rc, lc) if k_is_lhs else (lc, rc)
    qb, kb = (rb, lb) if k_is_lhs else (lb, rb)
    qfree, kfree = (rfree, lfree) if k_is_lhs else (lfree, rfree)
    q_out0 = nb + (len(lfree) if k_is_lhs else 0)
    k_out0 = nb + (0 if k_is_lhs else len(lfree))
    if len(kfree) != 1:
        raise NoMatch(
            f"the softmax axis is not the key axis (the key side has {len(kfree)} free dims)", eqn=dot
        )
    if len(qc) != 1:
        raise NoMatch(f"the QK product contracts {len(qc)} dims (expected the head dim only)", eqn=dot)
    if not qfree:
        raise NoMatch("the query side of the QK product has no free (sequence) dim", eqn=dot)
    qfree_out = [q_out0 + j for j in range(len(qfree))]
    assert k_out0 == s_dot

    # ---- probabilities down to PV
    zero_preds = [(pred, keep, sm.p, list(t_dims)) for pred, keep in sm.zero_preds]
    sum_path = {id(e) for e in sm.deferred.eqns} if sm.deferred is not None else set()
    explained |= sum_path
    cur, pdims = sm.p, list[Any](t_dims)
    while True:
        cur_eqn = g.prod(cur)
        if cur in g.outvars:
            raise NoMatch(
                "the attention probabilities have other users: they are returned (attention maps "
                "are an output, so the scores must be materialized)",
                eqn=cur_eqn,
            )
        users = [u for u in g.users.get(cur, ()) if id(u) not in sum_path]
        if len(users) > 1:
            raise NoMatch(
                "the attention probabilities have other users (returned, reused or dropped out)", eqn=users[1]
            )
        if not users:
            raise NoMatch("the attention probabilities are not used (no PV product)", eqn=cur_eqn)
        u = users[0]
        name = u.primitive.name
        explained.add(id(u))
        if name == "dot_general":
            if any(u.params["dimension_numbers"][0]):
                break  # a contraction: the PV product
            pdims = _unit_product(g, u, cur, pdims)
        elif name == "mul" and shape(u.outvars[0]) == shape(cur) and _all_ones(g, _other(u, cur)):
            pass
        elif name in ("convert_element_type", "copy", "copy_p"):
            pass
        elif name == "transpose":
            pdims = [pdims[p] for p in u.params["permutation"]]
        elif (mapping := _unit_map(u)) is not None:
            pdims = [None if m is None else pdims[m] for m in mapping]
        elif (
            name == "select_n" and len(u.invars) == 3 and u.invars[2] is cur and g.scalar(u.invars[1]) == 0.0
        ):
            zero_preds.append((u.invars[0], True, cur, list(pdims)))
        elif name in ("mul", "div"):
            raise NoMatch(
                "the probabilities are multiplied by a tensor or rescaled (dropout, or a post-softmax "
                "mask without renormalisation)",
                eqn=u,
            )
        else:
            raise NoMatch(f"`{name}` between the softmax and the PV product", eqn=u)
        cur = u.outvars[0]
    pv = u
    if None in pdims:
        raise NoMatch("size-1 dims of the probabilities reach the PV product", eqn=pv)
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
    for pi, vi in zip(pb, vb, strict=False):
        if pdims[pi] >= nb:
            raise NoMatch("the PV product batches over a non-batch dim of the scores", eqn=pv)
        v_batch[pdims[pi]] = vi
    if sorted(v_batch) != list(range(nb)):
        raise NoMatch("the PV product does not keep every batch dim of the QK product", eqn=pv)
    p_free = [pdims[d] for d in range(len(pdims)) if d not in pc and d not in pb]
    if sorted(p_free) != sorted(qfree_out):
        raise NoMatch("the PV product's free dims are not the query dims", eqn=pv)
    vfree = [d for d in range(len(shape(v))) if d not in vc and d not in vb]
    if len(vfree) != 1:
        raise NoMatch(
            f"the value side of the PV product has {len(vfree)} free dims (expected head_dim)", eqn=pv
        )
    pv_roles: list[tuple[Any, ...]] = [("d", pdims[pi]) for pi in pb]
    p_free_dims = [d for d in range(len(pdims)) if d not in pc and d not in pb]
    free_roles = [("d", pdims[d]) for d in p_free_dims]
    pv_roles += (free_roles + [("dv",)]) if p_is_lhs else ([("dv",)] + free_roles)
    anchor = pv
    if sm.deferred is not None:
        anchor, norm_eqns, pv_roles = _deferred_division(g, pv, pv_roles, sm.deferred.z, t_dims, sm.axis)
        explained.update(id(e) for e in (*norm_eqns, anchor))

    scale, softcap, biases, masks = _algebra(g, annotated, t_dtype)

    # ---- zero-masks must repeat a pre-softmax mask
    pre_keys = {(g.key(m.var), m.dmap, m.keep_when_true) for m in masks}
    for pred, keep, at, at_dims in zero_preds:
        src, dmap = _term(g, pred, at, at_dims)
        if (g.key(src), dmap, keep) not in pre_keys:
            raise NoMatch(
                "a post-softmax mask differs from the pre-softmax mask (dropout, or no renormalisation)"
            )

    # ---- escape rule: every equation between the two products is explained and private
    _check_internal(g, dot, anchor, [cur] if anchor is pv else anchor.invars, explained)

    # ---- canonical layout
    t_out = max(qfree_out, key=lambda d: (shape(dot.outvars[0])[d], -d))
    g_out = [d for d in qfree_out if d != t_out]
    h_idx = nb - 1 if nb else None
    rest = list(range(nb - 1)) if nb else []
    canon_dims = rest + ([h_idx] if h_idx is not None else []) + g_out + [t_out, s_dot]
    nr, nh = len(rest), (1 if h_idx is not None else 0)
    groups = [
        list(range(nr)),
        list(range(nr, nr + nh + len(g_out))),
        [nr + nh + len(g_out)],
        [nr + nh + len(g_out) + 1],
    ]
    qd = {q_out0 + j: qfree[j] for j in range(len(qfree))}
    q_order = tuple(
        [qb[i] for i in rest] + [qd[t_out]] + ([qb[h_idx]] if nh else []) + [qd[d] for d in g_out] + [qc[0]]
    )
    k_order = tuple([kb[i] for i in rest] + [kfree[0]] + ([kb[h_idx]] if nh else []) + [kc[0]])
    v_order = tuple([v_batch[i] for i in rest] + [vc[0]] + ([v_batch[h_idx]] if nh else []) + [vfree[0]])
    out_sh = shape(dot.outvars[0])
    sizes = {
        "B": [out_sh[i] for i in rest],
        "H": out_sh[h_idx] if h_idx is not None else None,
        "G": [out_sh[d] for d in g_out],
        "T": out_sh[t_out],
        "S": out_sh[s_dot],
        "D": shape(q)[qc[0]],
        "Dv": shape(v)[vfree[0]],
    }
    # PV output roles -> canonical unflattened output [rest..., T, H?, G..., Dv]
    canon_out = (
        [("d", i) for i in rest]
        + [("d", t_out)]
        + ([("d", h_idx)] if nh else [])
        + [("d", d) for d in g_out]
        + [("dv",)]
    )
    out_perm = tuple(canon_out.index(r) for r in pv_roles)

    # ---- scale factors folded into q or k
    q_src, fq, _q_eqns = _peel_scale(g, q)
    k_src, fk, _k_eqns = _peel_scale(g, k)
    scale *= fq * fk

    # ---- K/V repeated over heads (jnp.repeat, broadcast_to + reshape): pass the un-repeated K/V
    sizes["Hkv"] = sizes["H"]
    if nh:
        fold_k = fold_repeat(g, k_src, k_order, nr + 1, scales=True)
        fold_v = fold_repeat(g, v, v_order, nr + 1)
        if fold_k and fold_v and fold_k[2] == fold_v[2]:
            (k_src, k_order, sizes["Hkv"], factor), (v, v_order, _, _) = fold_k, fold_v
            scale *= factor

    # ---- positional masks from constants (iota comparisons, tril, constant arrays)
    causal, window, align, pos_empty, masks = positional.extract(g, masks, canon_dims, out_sh, groups)

    dtypes = {np.dtype(x.aval.dtype) for x in (q_src, k_src, v)}
    dtype = np.result_type(*dtypes)
    if dtype.name not in SUPPORTED_DTYPES:
        raise NoMatch(f"dtype {dtype.name} is not supported by flashport.attention")

    empty = _empty_semantics(masks, zero_preds, pos_empty)
    info = {
        "location": location(dot),
        "scores_shape": shape(sm.t),
        "pv_location": location(pv),
        "q_shape": shape(q_src),
        "k_shape": shape(k_src),
        "v_shape": shape(v),
        "layout": _layout(q_src, q_order, nr, nh, len(g_out), "T")
        + ","
        + _layout(k_src, k_order, nr, nh, 0, "S")
        + "->"
        + _out_layout(pv_roles, canon_out, nr, nh),
        "scale": scale,
        "softcap": softcap,
        "mask": _mask_kind(causal, window, align, masks, biases, zero_preds, g, canon_dims, groups),
        "dtypes": "/".join(sorted({str(x.aval.dtype) for x in (q, k, v)})),
        "softmax_dtype": str(t_dtype),
        "gqa": (sizes["H"] or 1) * math.prod(sizes["G"]) // (sizes["Hkv"] or 1),
        "empty_rows": empty or "-",
        "_eqns": list(sm.eqns),
    }
    if sm.deferred is not None:
        info["normalized"] = "after PV"
    return Match(
        anchor=anchor,
        q=q_src,
        k=k_src,
        v=v,
        q_order=q_order,
        k_order=k_order,
        v_order=v_order,
        sizes=sizes,
        out_perm=out_perm,
        canon_dims=canon_dims,
        groups=groups,
        scale=float(scale),
        softcap=softcap,
        biases=biases,
        masks=masks,
        causal=causal,
        window=window,
        align=align,
        empty=empty,
        dtype=dtype.name,
        out_dtype=np.dtype(anchor.outvars[0].aval.dtype),
        info=info,
    )


def _other(eqn, x):
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
    other = _other(u, p)
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


def _peel_scale(g: Graph, v):
    factor, eqns = 1.0, []
    while (e := g.prod(v)) is not None and e.primitive.name in ("mul", "div"):
        a, b = e.invars
        if e.primitive.name == "mul" and (s := g.scalar(a)) is not None and shape(b) == shape(v):
            nxt = b
        elif (s := g.scalar(b)) is not None and shape(a) == shape(v):
            nxt = a
            if e.primitive.name == "div":
                s = 1.0 / s if s else 0.0
        else:
            break
        if not s or np.dtype(nxt.aval.dtype) != np.dtype(v.aval.dtype):
            break
        factor *= s
        eqns.append(e)
        v = nxt
    return v, factor, eqns


def _deferred_division(g: Graph, pv, pv_roles, z, t_dims, axis):
    """``pv`` of an unnormalized exp must be divided by its row sum ``z``: ``(div eqn, eqns, roles)``.

    Transposes and casts of the product may come first; ``roles`` are the division output's dim roles.

    Accepted: ``pv / bcast(z)``, ``pv * bcast(1 / z)`` and ``pv * bcast(z ** -1)``, where each element
    of the product is divided by the sum of the row (batch and query indices) it came from.
    """
    from flashport.rewriter.jaxpr.softmax import reciprocal_of

    o, roles, eqns = pv.outvars[0], list(pv_roles), []
    u = pv  # the equation that produced ``o``: named in the reason when ``o`` has other users
    while True:
        users = g.users.get(o, ())
        if o in g.outvars or len(users) != 1:
            raise NoMatch(
                "softmax normalized after the PV product, but the unnormalized product has other users", eqn=u
            )
        u = users[0]
        name = u.primitive.name
        if name == "transpose":
            roles = [roles[p] for p in u.params["permutation"]]
        elif name not in ("convert_element_type", "copy", "copy_p"):
            break
        eqns.append(u)
        o = u.outvars[0]
    if name not in ("div", "mul") or (name == "div" and u.invars[0] is not o) or u.invars[0] is u.invars[1]:
        raise NoMatch(
            f"the PV product of the unnormalized exp is followed by `{name}`, not a division by "
            "the softmax sum",
            eqn=u,
        )
    if shape(u.outvars[0]) != shape(o):
        raise NoMatch("the division after the PV product broadcasts the product", eqn=u)
    other = _other(u, o)
    src, dims, more = peel_broadcast(g, other, operand_dims(other, shape(o)))
    eqns += more
    if name == "mul":
        r = reciprocal_of(g, src)
        if r is None:
            raise NoMatch(
                "the PV product of the unnormalized exp is multiplied by something other than "
                "the reciprocal of the softmax sum",
                eqn=u,
            )
        src, dims2, more = peel_broadcast(g, r[0])
        dims = [None if d is None else dims2[d] for d in dims]
        eqns += [r[1], *more]
    if src is not z:
        raise NoMatch(
            "the PV product of the unnormalized exp is divided by something other than the sum of that exp",
            eqn=u,
        )
    zdims = [d for i, d in enumerate(t_dims) if i != axis]
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
    return u, eqns, roles


def _check_internal(g: Graph, dot, end, start, explained):
    """Escape rule: everything between ``dot`` and ``end`` that ``start`` needs is explained and private."""
    i0, i1 = g.index[id(dot)], g.index[id(end)]
    eqns = g.jaxpr.eqns
    reached = {dot.outvars[0]}
    fwd = set()
    for e in eqns[i0 + 1 : i1]:
        if any(x in reached for x in e.invars if not hasattr(x, "val")):
            reached.update(e.outvars)
            fwd.add(id(e))
    need = {x for x in start if not hasattr(x, "val")}
    internal = []
    for e in reversed(eqns[i0 + 1 : i1]):
        if any(o in need for o in e.outvars):
            need.update(x for x in e.invars if not hasattr(x, "val"))
            if id(e) in fwd:
                internal.append(e)
    inside = {id(e) for e in internal} | {id(end)}
    known = {g.key(o) for e in eqns[i0 : i1 + 1] if id(e) in explained for o in e.outvars}
    for e in [dot, *internal]:
        if id(e) not in explained and not all(g.key(o) in known for o in e.outvars):
            raise NoMatch(
                f"`{e.primitive.name}` between the QK and PV products is not part of the pattern", eqn=e
            )
        for o in e.outvars:
            if o in g.outvars or any(id(u) not in inside for u in g.users.get(o, ())):
                what = "scores" if e is dot else f"`{e.primitive.name}` output"
                raise NoMatch(f"the {what} inside the attention are also used elsewhere (escape)", eqn=e)


def _empty_semantics(masks, zero_preds, pos_empty):
    if zero_preds:
        return "zero"
    if not masks and not pos_empty:
        return None
    fills = {m.fill for m in masks}
    if pos_empty:
        fills.add(pos_empty)
    if len(fills) > 1:
        raise NoMatch("masks with different fill values (fully masked rows would not be reproducible)")
    fill = fills.pop()
    return "nan" if fill == -np.inf else "mean"


def _layout(var, order, nr, nh, ng, seq):
    letters = ["B"] * nr + [seq] + ["N"] * nh + ["G"] * ng + ["D"]
    out = ["?"] * len(shape(var))
    for letter, d in zip(letters, order, strict=False):
        out[d] = letter
    return "".join(out)


def _out_layout(pv_roles, canon_out, nr, nh):
    letters = ["B"] * nr + ["T"] + ["N"] * nh + ["G"] * (len(canon_out) - nr - nh - 2) + ["D"]
    return "".join(letters[canon_out.index(r)] for r in pv_roles)


def _mask_kind(causal, window, align, masks, biases, zero_preds, g, canon_dims, groups):
    parts = []
    if causal:
        parts.append(f"causal({align})")
    if window is not None:
        parts.append(f"window{tuple(window)}({align})")
    for m in masks:
        kind = "segment-eq" if _is_segment(g, m.var) else "bool mask"
        if is_key_padding(m.dmap, canon_dims, groups):
            kind = "key-padding mask (as kv segment ids)"
        parts.append(f"{kind}{list(shape(m.var))} fill={m.fill:g}")
    for b in biases:
        parts.append(f"bias{list(shape(b.var))}")
    if zero_preds:
        parts.append("post-mask")
    return ", ".join(parts) or "none"


def _is_segment(g: Graph, v) -> bool:
    e = g.prod(v)
    while e is not None and e.primitive.name in ("convert_element_type", "broadcast_in_dim", "reshape"):
        e = g.prod(e.invars[0])
    return e is not None and e.primitive.name == "eq"
