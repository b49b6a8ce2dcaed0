"""The scores path of an attention site: from the softmax input up to the QK ``dot_general``.

:func:`walk_up` lists the :class:`Stage` s between the QK product and the softmax input (casts,
transposes, size-1 reshapes, scalar scales, softcap ``tanh``, additive bias, ``where``/multiply-add
masks), :func:`annotate` gives each stage's output dims in terms of the QK product's output dims,
and :func:`algebra` folds them into the contract's ``scale``, ``softcap``, bias and mask terms.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from flashport.fusion.axes import operand_dims, peel_broadcast, shape, unit_reshape_map
from flashport.fusion.graph import Graph
from flashport.fusion.softmax import NoMatch

# A mask fill at or below this (in the softmax dtype) zeroes its probability for any sane score.
MIN_FILL = -1e4
CASTS = ("convert_element_type", "copy", "copy_p")


@dataclasses.dataclass
class Term:
    """A bias or mask operand: ``var``'s dims map to QK-output dims (None = size-1/broadcast)."""

    var: object
    dmap: tuple
    mult: float = 1.0  # bias multiplier (scales applied after the add)
    keep_when_true: bool = True  # mask polarity
    fill: float = -np.inf  # mask fill (after later scalings)


class Stage(NamedTuple):
    """One equation on the scores path, between the QK product and the softmax input.

    ``kind`` is one of ``cast``, ``perm`` (``value`` = permutation), ``remap`` (``value`` = output
    dim -> input dim map of a size-1 reshape), ``tanh``, ``scale`` (``value`` = the factor), ``shift``
    (a scalar added: the softmax ignores it), ``bias`` (``value`` = sign, ``operand`` = the bias) or
    ``mask`` (``value`` = ``(fill, keep_when_true)``, ``operand`` = the predicate, ``inner`` = the
    ``s * m`` equation of a multiply-add mask). ``dims`` (set by :func:`annotate`) lists, for each
    dim of ``out``, the QK-output dim it shows (None for a size-1 dim the product lacks).
    """

    kind: str
    value: Any
    operand: Any
    eqn: Any
    out: Any
    inner: Any = None
    dims: tuple | None = None


class ScoresPath(NamedTuple):
    """The QK product, the annotated stages from it down to the softmax input, and their equations."""

    dot: Any
    stages: list  # Stage, from the dot downwards, with dims
    t_dims: list  # QK-output dim shown by each dim of the softmax input
    eqns: list  # the equations of the stages (and multiply-add inner products)


def scores_path(g: Graph, t) -> ScoresPath:
    """Walk from the softmax input ``t`` up to the QK product; annotate the stages with their dims."""
    dot, stages = walk_up(g, t)
    stages, t_dims = annotate(dot, stages)
    eqns = [s.eqn for s in stages] + [s.inner for s in stages if s.inner is not None]
    return ScoresPath(dot=dot, stages=stages, t_dims=t_dims, eqns=eqns)


def walk_up(g: Graph, c, depth=0):
    """From the softmax input up to the QK product: ``(dot_eqn, stages)``, stages from ``c`` upwards."""
    if depth > 64:
        raise NoMatch("scores path too long")
    e = g.prod(c)
    if e is None:
        raise NoMatch("the softmax input is not computed from a dot_general")
    if e.primitive.name == "dot_general":
        return e, []
    if e.primitive.name in ("add", "sub"):
        mul_add = _mul_add_mask(g, e, c)
        if mul_add is None:
            return _walk_through_add(g, e, c, depth)
        up, fill, pred, inner = mul_add
        stage = Stage("mask", (fill, True), pred, e, c, inner=inner)
    else:
        stage, up = _stage_of(g, e, c)
    dot, stages = walk_up(g, up, depth + 1)
    return dot, [stage, *stages]


def _stage_of(g: Graph, e, c):
    """The :class:`Stage` of the single-path equation ``e`` (output ``c``) and the var above it."""
    name, ins = e.primitive.name, e.invars
    if name in CASTS:
        return Stage("cast", None, None, e, c), ins[0]
    if name == "transpose":
        return Stage("perm", e.params["permutation"], None, e, c), ins[0]
    if name == "tanh":
        return Stage("tanh", None, None, e, c), ins[0]
    if (mapping := unit_map(e)) is not None:  # size-1 dims added/removed (jnp.matmul with B=1)
        return Stage("remap", mapping, None, e, c), ins[0]
    if name == "mul":
        s0, s1 = g.scalar(ins[0]), g.scalar(ins[1])
        if s1 is not None and shape(ins[0]) == shape(c):
            return Stage("scale", s1, None, e, c), ins[0]
        if s0 is not None and shape(ins[1]) == shape(c):
            return Stage("scale", s0, None, e, c), ins[1]
        raise NoMatch("the scores are multiplied by a non-constant or a tensor (not a scalar scale)", eqn=e)
    if name == "div":
        s1 = g.scalar(ins[1])
        if s1 is None or s1 == 0 or shape(ins[0]) != shape(c):
            raise NoMatch("the scores are divided by a non-constant or a tensor (not a scalar scale)", eqn=e)
        return Stage("scale", 1.0 / s1, None, e, c), ins[0]
    if name == "select_n" and len(ins) == 3:
        pred, f, s = ins
        sf, ss = g.scalar(f), g.scalar(s)
        if sf is not None and ss is None:
            return Stage("mask", (sf, True), pred, e, c), s
        if ss is not None and sf is None:
            return Stage("mask", (ss, False), pred, e, c), f
        raise NoMatch("select between two tensors on the scores (not a mask with a constant fill)", eqn=e)
    raise NoMatch(f"`{name}` on the scores path is not part of the attention contract", eqn=e)


def _walk_through_add(g: Graph, e, c, depth):
    """An ``add``/``sub`` on the scores: the operand with a QK product above it is the scores."""
    name, ins = e.primitive.name, e.invars
    first_err = None
    for pos in (0, 1) if name == "add" else (0,):
        if shape(ins[pos]) != shape(c):
            continue
        try:
            dot, stages = walk_up(g, ins[pos], depth + 1)
        except NoMatch as err:
            first_err = first_err or err
            continue
        other = ins[1 - pos]
        sign = -1.0 if name == "sub" else 1.0
        kind = "shift" if g.scalar(other) is not None else "bias"
        return dot, [Stage(kind, sign, other, e, c), *stages]
    raise first_err or NoMatch(f"`{name}` on the scores with no dot_general above it")


def annotate(dot, stages):
    """``stages`` (from the softmax input upwards) from the dot downwards, each with its dims."""
    dims = list(range(len(shape(dot.outvars[0]))))
    out = []
    for stage in reversed(stages):
        if stage.kind == "perm":
            dims = [dims[p] for p in stage.value]
        elif stage.kind == "remap":
            dims = [None if m is None else dims[m] for m in stage.value]
        out.append(stage._replace(dims=tuple(dims)))
    return out, dims


def _mul_add_mask(g: Graph, e, c):
    """``s * m + (1 - m) * fill``, ``m`` a 0/1 float cast of a boolean: ``(s, fill, m, s*m eqn)`` or None.

    For finite scores this equals ``where(m, s, fill)`` exactly (``0 * fill`` is ``-0.0``).
    """
    if e.primitive.name != "add":
        return None
    for a, b in (e.invars, e.invars[::-1]):
        b_src, b_dims, _ = peel_broadcast(g, b, operand_dims(b, shape(c)), casts=False)
        ea, eb = g.prod(a), g.prod(b_src)
        if ea is None or eb is None or ea.primitive.name != "mul" or eb.primitive.name != "mul":
            continue
        for x, m in (ea.invars, ea.invars[::-1]):
            if shape(x) != shape(c) or g.scalar(x) is not None:
                continue
            m_src = bool_source(g, m, shape(c))
            if m_src is None:
                continue
            for t, f in (eb.invars, eb.invars[::-1]):
                fill = g.scalar(f)
                if fill is None or shape(t) != shape(b_src):
                    continue
                if _is_one_minus(g, t, b_dims, m_src):
                    return x, fill, m, ea
    return None


def _is_one_minus(g: Graph, t, dims, m_src) -> bool:
    """Whether ``t`` (with ``dims``) is ``1 - m`` for the float cast ``m`` of the boolean ``m_src``."""
    one_minus = peel_broadcast(g, t, dims, casts=False)
    es = g.prod(one_minus[0])
    if es is None or es.primitive.name != "sub" or g.scalar(es.invars[0]) != 1.0:
        return False
    inner = peel_broadcast(g, es.invars[1], list(one_minus[1]), casts=True)
    return (g.key(inner[0]), inner[1]) == (g.key(m_src[0]), m_src[1])


def bool_source(g: Graph, m, out_shape):
    """``(src, dims)`` when the float ``m`` is a (broadcast) cast of the boolean ``src``, else None."""
    src, dims, _ = peel_broadcast(g, m, operand_dims(m, out_shape), casts=True)
    if np.dtype(src.aval.dtype) != np.bool_ or np.dtype(m.aval.dtype) == np.bool_:
        return None
    return src, dims


def unit_map(e):
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


def term(g: Graph, y, out_var, out_dims, mask=False):
    """Bias/mask operand ``y`` of an op whose output ``out_var`` has QK dims ``out_dims``.

    For a mask, a float cast of a boolean (the multiply-add form) is traced back to the boolean.
    """
    bool_src = bool_source(g, y, shape(out_var)) if mask else None
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


class Algebra(NamedTuple):
    """The scores stages folded into the contract: ``scale``, ``softcap``, bias and mask terms."""

    scale: float
    softcap: float | None
    biases: list
    masks: list


def algebra(g: Graph, stages, t_dtype) -> Algebra:
    """Fold the annotated ``stages`` (dot -> softmax input) into contract terms."""
    alpha, beta, tanh = 1.0, 1.0, False
    biases: list[Term] = []
    masks: list[Term] = []
    for st in stages:
        if st.kind == "scale":
            if tanh:
                if biases or masks:
                    raise NoMatch("scores scaled after softcap and bias/mask (not the contract order)")
                beta *= st.value
            else:
                alpha *= st.value
                _scale_terms(biases, masks, st.value)
        elif st.kind == "tanh":
            if tanh or biases or masks:
                raise NoMatch("tanh applied after bias/mask (softcap must come before them)")
            tanh = True
        elif st.kind == "bias":
            src, dmap = term(g, st.operand, st.out, st.dims)
            biases.append(Term(var=src, dmap=dmap, mult=st.value))
        elif st.kind == "mask":
            fill, keep = st.value
            src, dmap = term(g, st.operand, st.out, st.dims, mask=True)
            masks.append(Term(var=src, dmap=dmap, keep_when_true=keep, fill=fill))
    if tanh and beta <= 0:
        raise NoMatch("tanh on the scores is not a softcap (non-positive cap)")
    _check_fills(masks, t_dtype)
    return Algebra((alpha * beta if tanh else alpha), (beta if tanh else None), biases, masks)


def _scale_terms(biases, masks, val):
    """A scale after bias/mask terms scales the bias multipliers and the mask fills."""
    for b in biases:
        b.mult *= val
    for m in masks:
        if val <= 0:
            raise NoMatch("masked scores multiplied by a non-positive constant")
        m.fill *= val


def _check_fills(masks, t_dtype):
    for m in masks:
        fill = float(np.asarray(m.fill, dtype=t_dtype))
        if not fill <= MIN_FILL:
            raise NoMatch(f"mask fill {m.fill:g} is not negative enough to zero a probability in {t_dtype}")
