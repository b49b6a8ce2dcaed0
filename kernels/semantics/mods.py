"""``score_mod`` and ``mask_mod``: FlexAttention's user functions, traced once and run in every tile.

A user writes scalar functions, FlexAttention's convention::

    score_mod(score, batch, head, q_idx, kv_idx) -> score   # float32 score, int32 indices
    mask_mod(batch, head, q_idx, kv_idx) -> bool            # True = attend

:func:`trace` turns one into a :class:`TracedMod` (its jaxpr, static and hashable by its text, so a
mod rebuilt per call with the same code still hits the jit cache) and the arrays it closes over
(a slope per head, a relative-bias table, document ids). Those arrays travel as ordinary inputs of
the attention op, so they may be traced values and JAX differentiates them: gradients flow to them
as well as to q, k and v. :func:`broadcast_apply` vectorizes the scalar function over broadcast
index grids (nested ``vmap``, one per axis that varies), which is how each backend runs a mod over
its score tile. Indices are the raw positions ``0..Sq-1`` / ``0..Sk-1`` and the query head (not the
kv head under GQA), whatever ``align`` says.

:class:`Mods` bundles what one call carries (the traced mods, their arrays, the block mask) as a
pytree: backends that declare the ``score_mod`` / ``mask_mod`` features receive it as ``mods=``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# The abstract scalars a mod is traced with: (score), batch, head, q_idx, kv_idx.
_SCORE = jax.ShapeDtypeStruct((), jnp.float32)
_INDEX = jax.ShapeDtypeStruct((), jnp.int32)
SIGNATURES = {
    "score_mod": (_SCORE, _INDEX, _INDEX, _INDEX, _INDEX),
    "mask_mod": (_INDEX, _INDEX, _INDEX, _INDEX),
}


class ModError(TypeError):
    """A mod that cannot be traced, with a message that already names what it uses and what a mod may
    contain (the torch routes' proxies raise it); :func:`trace` passes it on unchanged."""


@dataclasses.dataclass(frozen=True, eq=False)
class TracedMod:
    """A mod as a jaxpr over (closed-over arrays..., scalars...); equal when the jaxpr text is."""

    kind: str
    jaxpr: Any  # jax.core.Jaxpr whose constvars are the closed-over arrays
    key: str
    # True: the last closed-over array is an int32 [4] of (batch, head, q_idx, kv_idx) offsets added
    # to the indices before the jaxpr runs (see :meth:`Mods.shifted`).
    shifted: bool = False

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TracedMod) and self.key == other.key

    def __call__(self, consts: tuple, *scalars: Any) -> Any:
        """Evaluate on scalars (or under ``vmap``) with the closed-over arrays ``consts``."""
        arrays = list(consts)
        n = len(scalars) - 4  # the score (score_mod) stays as it is
        indices = scalars[n:]
        if self.shifted:
            offsets = arrays.pop()
            indices = tuple(x + offsets[a] for a, x in enumerate(indices))
        # The jaxpr was traced on int32 indices; under jax_enable_x64 a caller's grids (and index
        # arithmetic with Python ints) are int64, which the jaxpr's lax ops would reject.
        indices = tuple(jax.lax.convert_element_type(x, jnp.int32) for x in indices)
        (out,) = jax.core.eval_jaxpr(self.jaxpr, arrays, *scalars[:n], *indices)
        return out

    def shift(self) -> TracedMod:
        """This mod reading its indices shifted by offsets passed as one more closed-over array."""
        if self.shifted:
            raise ValueError("a shifted mod cannot be shifted again")
        return dataclasses.replace(self, shifted=True, key=self.key + "|shifted")


def trace(fn: Any, kind: str) -> tuple[TracedMod, tuple]:
    """Trace the user's ``score_mod`` / ``mask_mod`` ``fn`` on scalars: ``(TracedMod, arrays)``.

    Raises:
      TypeError naming ``kind`` when ``fn`` is not callable, does not take the scalars, or returns
      something other than one float (score_mod) or bool (mask_mod) scalar.
    """
    if not callable(fn):
        raise TypeError(f"{kind} must be a function, got {type(fn).__name__}")
    args = SIGNATURES[kind]
    names = "(score, batch, head, q_idx, kv_idx)" if kind == "score_mod" else "(batch, head, q_idx, kv_idx)"
    try:
        closed = jax.make_jaxpr(fn)(*args)
    except ModError:
        raise
    except TypeError as err:
        raise TypeError(
            f"{kind} must be a JAX function of the scalars {names} (index closed-over tables as "
            f"jax.numpy arrays, not numpy ones): {err}"
        ) from err
    outs = closed.out_avals
    want = "a bool" if kind == "mask_mod" else "a float"
    ok = len(outs) == 1 and outs[0].shape == ()
    if ok and kind == "mask_mod":
        ok = outs[0].dtype == jnp.bool_
    elif ok:
        ok = jnp.issubdtype(outs[0].dtype, jnp.floating)
    if not ok:
        got = ", ".join(str(a) for a in outs)
        raise TypeError(f"{kind} must return {want} scalar (one value per score), got {got}")
    consts = tuple(closed.consts)
    key = f"{kind}|{closed.jaxpr}|" + ";".join(f"{jnp.shape(c)}{jnp.result_type(c)}" for c in consts)
    return TracedMod(kind, closed.jaxpr, key), consts


def broadcast_apply(fn: Any, *args: Any) -> Any:
    """``fn`` of scalars applied elementwise over arrays that broadcast against each other.

    Nested ``vmap`` over each axis of the broadcast shape, mapping only the arguments that vary
    along it (an index that is constant along an axis stays unmapped, so a per-head table lookup
    stays a scalar index). Returns an array of the broadcast shape.
    """
    arrays = [jnp.asarray(a) for a in args]
    rank = max(a.ndim for a in arrays)
    arrays = [a.reshape((1,) * (rank - a.ndim) + a.shape) for a in arrays]
    return _apply_axes(fn, arrays)


def _apply_axes(fn: Any, arrays: list) -> Any:
    if all(a.ndim == 0 for a in arrays):
        return fn(*arrays)
    size = max(a.shape[0] for a in arrays)
    if size == 1:
        return _apply_axes(fn, [a[0] for a in arrays])[None]
    axes = [0 if a.shape[0] == size else None for a in arrays]
    squeezed = [a if axis == 0 else a[0] for a, axis in zip(arrays, axes, strict=True)]
    return jax.vmap(lambda *xs: _apply_axes(fn, list(xs)), in_axes=axes)(*squeezed)


@jax.tree_util.register_pytree_node_class
class Mods:
    """What one call carries: the traced mods, the arrays they close over, the block mask.

    Attributes:
      score / mask: :class:`TracedMod` or None (static).
      score_consts / mask_consts: the closed-over arrays (pytree leaves).
      blocks: a :class:`flashport.kernels.semantics.block_mask.BlockMask` for ``mask`` or None.
    """

    def __init__(self, score=None, score_consts=(), mask=None, mask_consts=(), blocks=None):
        self.score, self.score_consts = score, tuple(score_consts)
        self.mask, self.mask_consts = mask, tuple(mask_consts)
        self.blocks = blocks

    def tree_flatten(self):
        return (self.score_consts, self.mask_consts, self.blocks), (self.score, self.mask)

    @classmethod
    def tree_unflatten(cls, aux, children):
        score_consts, mask_consts, blocks = children
        return cls(aux[0], score_consts, aux[1], mask_consts, blocks)

    @property
    def features(self) -> frozenset[str]:
        """The :data:`flashport.kernels.contract.spec.FEATURES` this call needs (``score_mod``, ``mask_mod``)."""
        return frozenset(
            name for name, mod in (("score_mod", self.score), ("mask_mod", self.mask)) if mod is not None
        )

    def shifted(self, offsets: Any) -> Mods:
        """These mods seen from a piece of the arrays: ``offsets`` int32 ``[4]`` = the global
        (batch, head, q_idx, kv_idx) of the piece's first entry, added to the indices a backend
        passes (which count from 0 in the piece). The offsets ride as the last closed-over array of
        each mod, so they may be traced (ring attention's shard indices); there is no block mask."""
        offsets = jnp.asarray(offsets, jnp.int32)
        score = None if self.score is None else self.score.shift()
        mask = None if self.mask is None else self.mask.shift()
        score_consts = () if score is None else (*self.score_consts, offsets)
        mask_consts = () if mask is None else (*self.mask_consts, offsets)
        return Mods(score, score_consts, mask, mask_consts, None)

    def apply_score(self, s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        """``score_mod`` over the float32 scores ``s`` at broadcasting indices (``s`` if none)."""
        if self.score is None:
            return s
        consts = self.score_consts
        out = broadcast_apply(lambda *xs: self.score(consts, *xs), s, b, h, q, k)
        return out.astype(jnp.float32)

    def score_derivative(self, s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        """d score_mod / d score at each entry (``None`` without a score_mod); a ``jvp`` with unit
        tangents, since each output depends only on its own score."""
        if self.score is None:
            return None
        _, tangent = jax.jvp(
            lambda x: self.apply_score(x, b, h, q, k),
            (s,),
            (jnp.ones_like(s),),
        )
        return tangent

    def visible(self, b: Any, h: Any, q: Any, k: Any) -> Any:
        """``mask_mod`` over broadcasting indices as a bool array (``None`` without a mask_mod)."""
        if self.mask is None:
            return None
        consts = self.mask_consts
        return broadcast_apply(lambda *xs: self.mask(consts, *xs), b, h, q, k).astype(bool)
