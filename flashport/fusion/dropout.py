"""Attention-weight dropout on the probabilities, recognized so the contract's dropout can replace it.

A keep-mask is recognized when it is drawn by ``jax.random.bernoulli(key, keep, shape)`` or written
as ``jax.random.uniform(key, shape) < keep`` (both trace to JAX's ``_uniform`` call on one PRNG key,
with ``minval=0`` and ``maxval=1``), possibly broadcast (Flax's ``broadcast_dropout`` shares one mask
over batch and heads), and applied to the probabilities as

* ``p * (keep.astype(dtype) / keep_prob)`` (Flax ``dot_product_attention`` with ``dropout_rng``),
* ``keep.astype(dtype) * p / keep_prob`` (Haiku ``hk.dropout``),
* ``where(keep, p / keep_prob, 0)`` (Equinox ``nn.Dropout``, Keras ``Dropout``),

where the constant factors on the path multiply to ``1 / keep_prob`` (within the dtype's precision).
The fused site calls ``flashport.attention(..., dropout_rate=1 - keep_prob, dropout_rng=key)`` with
the same key (a batch of keys, as ``vmap`` over per-example keys gives in Equinox, passes its first
key: the contract's mask differs per batch element anyway): the same rate and the same 1/(1-rate)
scaling, but the contract draws its own mask
(:mod:`flashport.kernels.semantics.dropout`), per batch, head, query and key, so the kept entries differ from
the original program's. That is why :func:`flashport.fuse_attention` fuses dropout only with
``dropout="contract"``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from flashport.fusion.axes import operand_dims, peel_broadcast, shape
from flashport.fusion.graph import Graph
from flashport.fusion.softmax import NoMatch

CALLS = ("jit", "pjit", "closed_call", "core_call")


@dataclasses.dataclass
class Dropout:
    """Dropout found on a site's probabilities: its rate, the PRNG key it drew from, where it is."""

    rate: float
    rng: Any  # the key variable the keep-mask was drawn from (passed as ``dropout_rng``)
    eqn: Any  # the equation that applies the keep-mask (named in near-miss reasons)
    shared: bool  # the original mask was broadcast (shared over some dims of the probabilities)

    def describe(self) -> str:
        """One line for the report."""
        note = ", original mask shared over batch/heads" if self.shared else ""
        if shape(self.rng):
            note += f", first of {math.prod(shape(self.rng))} keys"
        return f"rate={self.rate:g} (contract's mask{note})"

    def key(self, read):
        """The ``dropout_rng`` to pass: the program's key (the first one of a batch of keys)."""
        rng = read(self.rng)
        return rng.reshape(-1)[0] if shape(self.rng) else rng


class DropoutWalk:
    """Collects the dropout stages met while walking the probabilities down to the PV product."""

    def __init__(self, g: Graph):
        self.g = g
        self.factor = 1.0  # product of the constant factors on the path
        self.first_scale: Any = None  # the first constant rescale (named when there is no keep-mask)
        self.mask: tuple | None = None  # (rng, keep_prob, keep dtype, shared, eqn)

    def step(self, u, cur) -> bool:
        """Whether ``u`` (the one user of the probabilities ``cur``) is a dropout stage; record it."""
        g, name = self.g, u.primitive.name
        if name in ("mul", "div") and len(u.invars) == 2 and u.invars[0] is not u.invars[1]:
            if shape(u.outvars[0]) != shape(cur):
                return False
            other = u.invars[1] if u.invars[0] is cur else u.invars[0]
            s = g.scalar(other)
            if s is not None:
                if s == 0 or (name == "div" and u.invars[0] is not cur):
                    return False
                self.factor *= s if name == "mul" else 1.0 / s
                self.first_scale = self.first_scale or u
                return True
            found = self._multiplier(other, shape(cur)) if name == "mul" else None
            if found is None:
                return False
            self._record(u, found[0], cur)
            self.factor *= found[1]
            return True
        if name == "select_n" and len(u.invars) == 3 and u.invars[2] is cur and g.scalar(u.invars[1]) == 0.0:
            drawn = keep_mask(g, u.invars[0])
            if drawn is None:
                return False  # an ordinary zero-mask
            self._record(u, drawn, cur)
            return True
        return False

    def _multiplier(self, other, out_shape):
        """``(keep-mask, factor)`` when ``other`` is ``keep.astype(float) [* or /] constant``."""
        g = self.g
        src, _, _ = peel_broadcast(g, other, operand_dims(other, out_shape), casts=False)
        factor = 1.0
        e = g.prod(src)
        if e is not None and e.primitive.name in ("mul", "div"):
            a, b = e.invars
            s, x = g.scalar(b), a
            if s is None and e.primitive.name == "mul":
                s, x = g.scalar(a), b
            if not s:
                return None
            factor, src = (s if e.primitive.name == "mul" else 1.0 / s), x
        if np.dtype(src.aval.dtype) == np.bool_:
            return None
        drawn = keep_mask(g, src)
        return None if drawn is None else (drawn, factor)

    def _record(self, u, drawn, cur):
        if self.mask is not None:
            raise NoMatch("two dropout keep-masks on the same probabilities", eqn=u)
        rng, keep, keep_dtype, n = drawn
        self.mask = (rng, keep, keep_dtype, n < math.prod(shape(cur)), u)

    def finish(self, pv) -> Dropout | None:
        """The site's :class:`Dropout`, None without one; raise when the path rescales otherwise."""
        if self.mask is None:
            if self.factor != 1.0:
                raise NoMatch(
                    "the probabilities are rescaled by a constant without a dropout keep-mask "
                    "(not a softmax)",
                    eqn=self.first_scale,
                )
            return None
        rng, keep, keep_dtype, shared, eqn = self.mask
        if not 0.0 < keep <= 1.0:
            raise NoMatch(f"dropout keep probability {keep:g} is not in (0, 1]", eqn=eqn)
        eps = float(np.finfo(np.dtype(pv.outvars[0].aval.dtype)).eps)
        if abs(self.factor * keep - 1.0) > 4 * eps:
            raise NoMatch(
                f"the dropout keep-mask (keep probability {keep:g}) is rescaled by {self.factor:g}, "
                f"not by 1/{keep:g} (not inverted dropout)",
                eqn=eqn,
            )
        return Dropout(rate=_rate(keep, keep_dtype), rng=rng, eqn=eqn, shared=shared)


def _rate(keep: float, dtype) -> float:
    """``1 - keep`` for the decimal the program wrote (``0.9`` as float32 is 0.8999999761...)."""
    short = float(np.format_float_positional(np.dtype(dtype).type(keep), unique=True))
    return float(f"{1.0 - short:.12g}")


def keep_mask(g: Graph, var):
    """``(rng, keep_prob, keep dtype, size of the drawn mask)`` when the boolean (or a float cast of a
    boolean) ``var`` is a possibly broadcast Bernoulli keep-mask, else None."""
    src, _, _ = peel_broadcast(g, var, casts=True)
    if np.dtype(src.aval.dtype) != np.bool_:
        return None
    e = g.prod(src)
    if e is None:
        return None
    if e.primitive.name in CALLS and "jaxpr" in e.params:  # jax.random.bernoulli: jit[_bernoulli](key, p)
        body = e.params["jaxpr"]
        idx = next(i for i, o in enumerate(e.outvars) if o is src)
        inner = Graph(body.jaxpr, body.consts)
        drawn = _uniform_below(inner, body.jaxpr.outvars[idx])
        if drawn is None:
            return None
        rng, keep, keep_var = drawn
        rng = _outer(e, body.jaxpr, rng)
        if keep is None:
            keep = g.scalar(_outer(e, body.jaxpr, keep_var)) if keep_var is not None else None
        drawn = (rng, keep, keep_var)
    else:
        drawn = _uniform_below(g, src)
    if drawn is None or drawn[0] is None or drawn[1] is None:
        return None
    rng, keep, keep_var = drawn
    if not _is_key(rng):
        return None
    return rng, keep, keep_var.aval.dtype, math.prod(shape(src))


def _uniform_below(g: Graph, v):
    """``(rng, keep or None, keep var)`` when ``v = uniform(rng, minval=0, maxval=1) < keep``."""
    e = g.prod(v)
    if e is None or e.primitive.name != "lt":
        return None
    u, keep_var = e.invars
    if shape(keep_var) != () and math.prod(shape(keep_var)) != 1:
        return None
    call = g.prod(u)
    if call is None or call.primitive.name not in CALLS or call.params.get("name") != "_uniform":
        return None
    if len(call.invars) != 3 or not _draws_bits(call.params["jaxpr"].jaxpr):
        return None
    if g.scalar(call.invars[1]) != 0.0 or g.scalar(call.invars[2]) != 1.0:
        return None
    keep = g.scalar(keep_var)
    if keep is None and not any(keep_var is x for x in g.jaxpr.invars):
        return None
    return call.invars[0], keep, keep_var


def _draws_bits(jaxpr) -> bool:
    return any(e.primitive.name == "random_bits" for e in jaxpr.eqns)


def _outer(call, body, v):
    """The operand of ``call`` bound to ``body``'s input ``v`` (None when ``v`` is not an input)."""
    for x, outer in zip(body.invars, call.invars, strict=True):
        if x is v:
            return outer
    return None


def _is_key(v) -> bool:
    """A typed PRNG key or a (vmapped) batch of them."""
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and math.prod(shape(v)) > 0
