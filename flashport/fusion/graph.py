"""A read-only dataflow view of one (normalized) jaxpr: producers, users, structural keys, constants.

The matcher asks questions such as "which equation made this variable", "who else reads it", "are
these two variables the same computation" (structural keys, so that ``jnp.where`` written twice
counts as one mask) and "is this value a compile-time constant, and what is it" (scale literals,
mask fills, iota-built causal masks).
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from flashport.fusion import consteval

# Ops whose value is the same tensor, seen through a dtype change or an identity.
IDENTITY_OPS = ("convert_element_type", "copy", "copy_p", "stop_gradient", "optimization_barrier")
# Largest constant (elements) that is evaluated at trace time to recognize masks.
MAX_CONST_ELEMENTS = 1 << 26


def is_literal(atom) -> bool:
    """True for a jaxpr ``Literal`` (an inline constant)."""
    return isinstance(atom, jcore.Literal)


class Graph:
    """Producer/user maps and constant folding over one jaxpr (``consts`` are its constvars' values)."""

    def __init__(self, jaxpr, consts=()):
        self.jaxpr = jaxpr
        self.producer: dict = {}
        self.users: dict = {}
        self.index: dict = {}
        self.consts = dict(zip(jaxpr.constvars, consts, strict=False))
        self.outvars = {v for v in jaxpr.outvars if not is_literal(v)}
        dead = _dead_eqns(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            self.index[id(eqn)] = i
            if i in dead:
                continue  # e.g. `_ = sign l` in logsumexp: not a user
            for v in eqn.invars:
                if not is_literal(v):
                    self.users.setdefault(v, []).append(eqn)
            for v in eqn.outvars:
                self.producer[v] = eqn
        self._keys: dict = {}
        self._table: dict = {}
        self._const: dict = {}

    # ------------------------------------------------------------------ structure

    def prod(self, v):
        """The equation producing ``v`` (None for literals, inputs and constvars)."""
        if is_literal(v):
            return None
        return self.producer.get(v)

    def n_users(self, v) -> int:
        """How many equations (plus the jaxpr outputs) read ``v``."""
        return len(self.users.get(v, ())) + (v in self.outvars)

    def key(self, v) -> int:
        """A structural key: equal keys mean the same computation on the same inputs.

        Keys are interned to small ints so that comparing or hashing them never walks the (shared,
        exponentially large when unfolded) ancestry of a residual stream.
        """
        if is_literal(v):
            return self._intern(("lit", _hashable(v.val), str(v.aval)))
        if v in self._keys:
            return self._keys[v]
        eqn = self.prod(v)
        if eqn is None:
            k = self._intern(("var", id(v)))
        elif (
            eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == v.aval.dtype
        ):  # a weak-type-only cast
            k = self.key(eqn.invars[0])
        else:
            k = self._intern(
                (
                    eqn.primitive.name,
                    _params_key(eqn.params),
                    tuple(self.key(x) for x in eqn.invars),
                    eqn.outvars.index(v),
                )
            )
        self._keys[v] = k
        return k

    def _intern(self, structure) -> int:
        return self._table.setdefault(structure, len(self._table))

    # ------------------------------------------------------------------ constants

    def const_value(self, v):
        """The concrete numpy value of ``v`` if it depends on no jaxpr input, else None.

        Walks through any pure primitives (iota, comparisons, broadcasts, literals, constvars); values
        larger than :data:`MAX_CONST_ELEMENTS` are not materialized.
        """
        if is_literal(v):
            return np.asarray(v.val)
        if v in self._const:
            return self._const[v]
        self._const[v] = None  # guards cycles and repeated failures
        if v in self.consts:
            val = self.consts[v]
            if isinstance(val, jax.core.Tracer):
                return None
            out = np.asarray(val)
        else:
            eqn = self.prod(v)
            if eqn is None or eqn.effects or _size(v) > MAX_CONST_ELEMENTS or len(eqn.outvars) != 1:
                return None
            vals = [self.const_value(x) for x in eqn.invars]
            if any(x is None for x in vals):
                return None
            out = consteval.evaluate(eqn, vals)
            if out is None:
                return None
        self._const[v] = out
        return out

    def scalar(self, v) -> float | None:
        """``v`` as a Python float when it is a constant scalar (or a constant broadcast of one)."""
        while (e := self.prod(v)) is not None and e.primitive.name in (
            "broadcast_in_dim",
            "convert_element_type",
            "reshape",
        ):
            v = e.invars[0]
        if _size(v) != 1:
            return None
        val = self.const_value(v)
        if val is None:
            return None
        flat = val.reshape(-1)
        if flat.size == 0 or (not np.all(flat == flat[0]) and not np.all(np.isnan(flat))):
            return None
        try:
            return float(flat[0])
        except (TypeError, ValueError):
            return None


def location(eqn) -> str:
    """``file:line (function)`` of the code that produced ``eqn``.

    When the innermost frame is inside an installed library (flax, transformers...), the first
    frame outside ``site-packages`` is appended, so the report points at the user's own call.
    """
    try:
        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:  # noqa: BLE001 -- source info is best effort
        return "?"
    if not frames:
        return "?"
    first = _frame(frames[0])
    if not _is_library(frames[0].file_name):
        return first
    mine = next((f for f in frames if not _is_library(f.file_name)), None)
    return first if mine is None else f"{first} <- {_frame(mine)}"


def _is_library(path: str) -> bool:
    return "site-packages" in path or "dist-packages" in path


def _frame(f) -> str:
    return f"{f.file_name}:{f.start_line} ({f.function_name})"


def _dead_eqns(jaxpr) -> set:
    live = {v for v in jaxpr.outvars if not is_literal(v)}
    dead = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(o in live for o in eqn.outvars):
            live.update(v for v in eqn.invars if not is_literal(v))
        else:
            dead.add(i)
    return dead


def _size(v) -> int:
    shape = getattr(v.aval, "shape", ())
    return int(np.prod(shape)) if shape else 1


def _hashable(val):
    arr = np.asarray(val)
    if arr.size <= 16:
        return (arr.dtype.str, arr.shape, arr.tobytes())
    return ("big", id(val))


def _params_key(params):
    items = []
    for name, val in sorted(params.items()):
        if isinstance(val, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            items.append((name, id(val)))
            continue
        try:
            hash(val)
            items.append((name, val))
        except TypeError:
            items.append((name, repr(val)))
    return tuple(items)
