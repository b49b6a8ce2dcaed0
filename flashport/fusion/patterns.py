"""Match ``softmax(Q·Kᵀ)·V`` in one normalized jaxpr, semantically rather than by templates.

Matching starts at every ``exp`` (the one op every softmax spelling shares): the softmax around it
(:mod:`.softmax`), then the scores path up to the QK ``dot_general`` (:mod:`.scores`: scale, softcap,
bias, masks, casts, transposes, with axes tracked), then the probabilities down to the PV
``dot_general`` (:mod:`.probs`, with dropout from :mod:`.dropout`). q, k and v roles come from the
dimension numbers: the softmax axis is k's only free dim, and the PV product must contract it
against v's sequence dim. Everything between the two products must be explained and have no other
users (the escape rule), otherwise the candidate is reported as a near-miss with the reason.
:func:`match_at` runs these stages in order, each returning a typed result (``ScoresPath``,
``QKRoles``, ``ProbPath``, ``PVRoles``, ``Algebra``, ``Layout``), and assembles the :class:`Match`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from flashport.fusion import positional
from flashport.fusion.axes import shape
from flashport.fusion.canon import is_key_padding
from flashport.fusion.gqa import fold_repeat
from flashport.fusion.graph import Graph, location
from flashport.fusion.probs import deferred_division, pv_roles, walk_down
from flashport.fusion.scores import algebra, scores_path, term
from flashport.fusion.softmax import NoMatch, match_softmax

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
DROPOUT_MODES = (None, "contract")


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
    dropout: Any = None  # a .dropout.Dropout when the site's dropout is fused (opt-in)

    @property
    def inputs(self):
        """Variables the replacement reads (for liveness)."""
        terms = [*(t.var for t in self.biases), *(t.var for t in self.masks)]
        rng = [self.dropout.rng] if self.dropout is not None else []
        return [self.q, self.k, self.v, *terms, *rng]


@dataclasses.dataclass
class Miss:
    """A near-miss: an exp that looked like attention but was not fused, and why."""

    eqn: object
    reason: str
    info: dict


def find_matches(g: Graph, dropout=None):
    """Return ``(matches, misses)`` for every attention-like ``exp`` in ``g``.

    ``dropout="contract"`` fuses attention-weight dropout into the contract's dropout; with the
    default ``None`` a site with dropout is a near-miss (see :func:`match_at`).
    """
    matches, misses, used = [], [], set()
    for eqn in g.jaxpr.eqns:
        if eqn.primitive.name != "exp":
            continue
        try:
            m = match_at(g, eqn, dropout)
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
    seen: set[int] = set()
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


# ----------------------------------------------------------------------------- the whole site


class QKRoles(NamedTuple):
    """Roles of the QK product's operands: which is q and k, and their contracting/batch/free dims."""

    q: Any
    k: Any
    qc: tuple  # q's contracting (head_dim) dim
    qb: tuple  # q's batch dims, in the product's batch order
    kb: tuple
    kc: tuple
    qfree: list  # q's free dims (query sequence, and query-only dims such as a GQA group)
    kfree: list  # k's free dim (the key sequence)
    nb: int  # number of batch dims
    qfree_out: list  # QK-output dims of q's free dims


class Layout(NamedTuple):
    """The canonical arrangement of a site: dims grouped into the contract's B, Hq, T, S."""

    canon_dims: list  # QK-output dims in canonical bias/mask order [rest..., H?, G..., T, S]
    groups: list  # canonical positions merged into B, Hq, T, S
    q_order: tuple
    k_order: tuple
    v_order: tuple
    sizes: dict
    canon_out: list  # canonical unflattened output roles [rest..., T, H?, G..., Dv]
    out_perm: tuple
    nr: int  # number of leading batch dims
    nh: int  # 1 when the product has a head batch dim, else 0
    ng: int  # number of query-only (group) dims


def match_at(g: Graph, exp_eqn, dropout=None) -> Match:
    """Match the attention site around ``exp_eqn`` or raise :class:`NoMatch` with the reason.

    ``dropout`` is :func:`find_matches`'s option: attention-weight dropout is part of a match only
    when it is ``"contract"``; otherwise such a site is a near-miss naming the opt-in.
    """
    sm = match_softmax(g, exp_eqn)
    sp = scores_path(g, sm.t)
    explained = {id(e) for e in (*sm.eqns, sp.dot, *sp.eqns)}
    t_dtype = np.dtype(sm.t.aval.dtype)
    s_dot = sp.t_dims[sm.axis]
    qk = _qk_roles(sp.dot, s_dot)
    down = walk_down(g, sm, sp.t_dims)
    if sm.deferred is not None:
        explained |= {id(e) for e in sm.deferred.eqns}
    explained |= {id(e) for e in down.eqns}
    pvr = pv_roles(down, s_dot, qk.nb, qk.qfree_out)
    anchor, roles = down.pv, pvr.roles
    if sm.deferred is not None:
        anchor, norm_eqns, roles = deferred_division(g, down.pv, roles, sm.deferred.z, sp.t_dims, sm.axis)
        explained.update(id(e) for e in (*norm_eqns, anchor))
    alg = algebra(g, sp.stages, t_dtype)
    _check_zero_masks(g, alg.masks, down.zero_preds)
    _check_internal(g, sp.dot, anchor, [down.p] if anchor is down.pv else anchor.invars, explained)
    _check_dropout(down.dropout, dropout)
    lay = _layout(sp.dot, s_dot, qk, pvr, roles)
    return _assemble(g, sm, sp, qk, pvr, down, lay, alg, anchor)


def _qk_roles(dot, s_dot) -> QKRoles:
    """Assign q and k from the QK product's dimension numbers and the softmax (key) axis."""
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
    if len(kfree) != 1:
        raise NoMatch(
            f"the softmax axis is not the key axis (the key side has {len(kfree)} free dims)", eqn=dot
        )
    if len(qc) != 1:
        raise NoMatch(f"the QK product contracts {len(qc)} dims (expected the head dim only)", eqn=dot)
    if not qfree:
        raise NoMatch("the query side of the QK product has no free (sequence) dim", eqn=dot)
    qfree_out = [q_out0 + j for j in range(len(qfree))]
    return QKRoles(q, k, tuple(qc), tuple(qb), tuple(kb), tuple(kc), qfree, kfree, nb, qfree_out)


def _check_zero_masks(g: Graph, masks, zero_preds):
    """Zero-masks after the softmax must repeat a pre-softmax mask (else the rows are not renormalized)."""
    pre_keys = {(g.key(m.var), m.dmap, m.keep_when_true) for m in masks}
    for pred, keep, at, at_dims in zero_preds:
        src, dmap = term(g, pred, at, at_dims)
        if (g.key(src), dmap, keep) not in pre_keys:
            raise NoMatch(
                "a post-softmax mask differs from the pre-softmax mask (dropout, or no renormalisation)"
            )


def _check_dropout(drop, mode):
    """A site with attention-weight dropout is fused only when the caller opted in."""
    if drop is not None and mode != "contract":
        raise NoMatch(
            f"attention-weight dropout (rate {drop.rate:g}) on the probabilities: pass "
            'fuse_attention(f, dropout="contract") to fuse it with flashport.attention\'s dropout '
            "(same rate, but the kept entries differ from this program's random bits)",
            eqn=drop.eqn,
        )


def _layout(dot, s_dot, qk: QKRoles, pvr, roles) -> Layout:
    """Group the QK-output dims into the contract's [B, Hq, T, S] and order q, k, v accordingly."""
    nb = qk.nb
    t_out = max(qk.qfree_out, key=lambda d: (shape(dot.outvars[0])[d], -d))
    g_out = [d for d in qk.qfree_out if d != t_out]
    rest = list(range(nb - 1)) if nb else []
    heads = [nb - 1] if nb else []  # the last batch dim of the product is the head dim
    nr, nh, ng = len(rest), len(heads), len(g_out)
    canon_dims = rest + heads + g_out + [t_out, s_dot]
    groups = [list(range(nr)), list(range(nr, nr + nh + ng)), [nr + nh + ng], [nr + nh + ng + 1]]
    q_out0 = qk.qfree_out[0]
    qd = {q_out0 + j: qk.qfree[j] for j in range(len(qk.qfree))}
    q_order = tuple(
        [qk.qb[i] for i in rest]
        + [qd[t_out]]
        + [qk.qb[i] for i in heads]
        + [qd[d] for d in g_out]
        + [qk.qc[0]]
    )
    k_order = tuple([qk.kb[i] for i in rest] + [qk.kfree[0]] + [qk.kb[i] for i in heads] + [qk.kc[0]])
    vb = pvr.v_batch
    v_order = tuple([vb[i] for i in rest] + [pvr.vc] + [vb[i] for i in heads] + [pvr.vfree])
    out_sh = shape(dot.outvars[0])
    sizes = {
        "B": [out_sh[i] for i in rest],
        "H": out_sh[heads[0]] if nh else None,
        "G": [out_sh[d] for d in g_out],
        "T": out_sh[t_out],
        "S": out_sh[s_dot],
        "D": shape(qk.q)[qk.qc[0]],
        "Dv": shape(pvr.v)[pvr.vfree],
    }
    canon_out = [("d", i) for i in rest] + [("d", t_out)] + [("d", i) for i in heads]
    canon_out += [("d", d) for d in g_out] + [("dv",)]
    out_perm = tuple(canon_out.index(r) for r in roles)
    return Layout(canon_dims, groups, q_order, k_order, v_order, sizes, canon_out, out_perm, nr, nh, ng)


def _assemble(g: Graph, sm, sp, qk: QKRoles, pvr, down, lay: Layout, alg, anchor) -> Match:
    """Fold scale factors, K/V head repeats and positional masks in; build the :class:`Match`."""
    q_src, fq, _ = _peel_scale(g, qk.q)
    k_src, fk, _ = _peel_scale(g, qk.k)
    scale = alg.scale * fq * fk
    v, k_order, v_order, sizes = pvr.v, lay.k_order, lay.v_order, dict(lay.sizes)
    sizes["Hkv"] = sizes["H"]
    if lay.nh:  # K/V repeated over heads (jnp.repeat, broadcast_to + reshape): pass the un-repeated K/V
        fold_k = fold_repeat(g, k_src, k_order, lay.nr + 1, scales=True)
        fold_v = fold_repeat(g, v, v_order, lay.nr + 1)
        if fold_k and fold_v and fold_k[2] == fold_v[2]:
            (k_src, k_order, sizes["Hkv"], factor), (v, v_order, _, _) = fold_k, fold_v
            scale *= factor
    out_sh = shape(sp.dot.outvars[0])
    causal, window, align, pos_empty, masks = positional.extract(
        g, alg.masks, lay.canon_dims, out_sh, lay.groups
    )
    dtype = np.result_type(*{np.dtype(x.aval.dtype) for x in (q_src, k_src, v)})
    if dtype.name not in SUPPORTED_DTYPES:
        raise NoMatch(f"dtype {dtype.name} is not supported by flashport.attention")
    empty = _empty_semantics(masks, down.zero_preds, pos_empty)
    lay = lay._replace(k_order=k_order, v_order=v_order, sizes=sizes)
    ctx = _Site(causal, window, align, masks, alg.biases, down.zero_preds, empty, scale, alg.softcap)
    info = _info(g, sm, sp, qk, down, lay, ctx, (q_src, k_src, v))
    return Match(
        anchor=anchor,
        q=q_src,
        k=k_src,
        v=v,
        q_order=lay.q_order,
        k_order=k_order,
        v_order=v_order,
        sizes=sizes,
        out_perm=lay.out_perm,
        canon_dims=lay.canon_dims,
        groups=lay.groups,
        scale=float(scale),
        softcap=alg.softcap,
        biases=alg.biases,
        masks=masks,
        causal=causal,
        window=window,
        align=align,
        empty=empty,
        dtype=dtype.name,
        out_dtype=np.dtype(anchor.outvars[0].aval.dtype),
        info=info,
        dropout=down.dropout,
    )


class _Site(NamedTuple):
    """The contract arguments of a site, as reported."""

    causal: bool
    window: tuple | None
    align: str
    masks: list
    biases: list
    zero_preds: list
    empty: str | None
    scale: float
    softcap: float | None


def _info(g: Graph, sm, sp, qk: QKRoles, down, lay: Layout, site: _Site, srcs) -> dict:
    """The report entry of a match (see :mod:`.report`)."""
    q_src, k_src, v = srcs
    info = {
        "location": location(sp.dot),
        "scores_shape": shape(sm.t),
        "pv_location": location(down.pv),
        "q_shape": shape(q_src),
        "k_shape": shape(k_src),
        "v_shape": shape(v),
        "layout": _letters(q_src, lay.q_order, lay.nr, lay.nh, lay.ng, "T")
        + ","
        + _letters(k_src, lay.k_order, lay.nr, lay.nh, 0, "S")
        + "->"
        + _out_layout(_anchor_roles(lay), lay.canon_out, lay.nr, lay.nh),
        "scale": site.scale,
        "softcap": site.softcap,
        "mask": _mask_kind(site, g, lay.canon_dims, lay.groups),
        "dtypes": "/".join(sorted({str(x.aval.dtype) for x in (qk.q, qk.k, v)})),
        "softmax_dtype": str(sm.t.aval.dtype),
        "gqa": (lay.sizes["H"] or 1) * math.prod(lay.sizes["G"]) // (lay.sizes["Hkv"] or 1),
        "empty_rows": site.empty or "-",
        "_eqns": list(sm.eqns),
    }
    if sm.deferred is not None:
        info["normalized"] = "after PV"
    if down.dropout is not None:
        info["dropout"] = down.dropout.describe()
        info["mask"] = f"{info['mask']}, dropout {info['dropout']}".removeprefix("none, ")
    return info


def _anchor_roles(lay: Layout):
    return [lay.canon_out[i] for i in lay.out_perm]


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


def _letters(var, order, nr, nh, ng, seq):
    letters = ["B"] * nr + [seq] + ["N"] * nh + ["G"] * ng + ["D"]
    out = ["?"] * len(shape(var))  # size-1 dims past the canonical ones (a folded head repeat) stay "?"
    for letter, d in zip(letters, order[: len(letters)], strict=True):
        out[d] = letter
    return "".join(out)


def _out_layout(pv_roles, canon_out, nr, nh):
    letters = ["B"] * nr + ["T"] + ["N"] * nh + ["G"] * (len(canon_out) - nr - nh - 2) + ["D"]
    return "".join(letters[canon_out.index(r)] for r in pv_roles)


def _mask_kind(site, g, canon_dims, groups):
    parts = []
    if site.causal:
        parts.append(f"causal({site.align})")
    if site.window is not None:
        parts.append(f"window{tuple(site.window)}({site.align})")
    for m in site.masks:
        kind = "segment-eq" if _is_segment(g, m.var) else "bool mask"
        if is_key_padding(m.dmap, canon_dims, groups):
            kind = "key-padding mask (as kv segment ids)"
        parts.append(f"{kind}{list(shape(m.var))} fill={m.fill:g}")
    for b in site.biases:
        parts.append(f"bias{list(shape(b.var))}")
    if site.zero_preds:
        parts.append("post-mask")
    return ", ".join(parts) or "none"


def _is_segment(g: Graph, v) -> bool:
    e = g.prod(v)
    while e is not None and e.primitive.name in ("convert_element_type", "broadcast_in_dim", "reshape"):
        e = g.prod(e.invars[0])
    return e is not None and e.primitive.name == "eq"
