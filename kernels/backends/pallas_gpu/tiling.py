"""Shared pieces of the Pallas GPU (Triton) attention kernels: geometry, loop bounds and one score tile.

Everything here runs inside a kernel body (or computes the static geometry the kernels close over).
Triton constraints respected: every array a kernel builds is a power of two along each dimension
(blocks >= 16, head dims padded to powers of two by :mod:`flashport.kernels.backends.pallas_gpu`), dots
accumulate in float32, and scalar loop bounds are computed from ``pl.program_id`` with integer
arithmetic instead of table loads.

Precision: bfloat16/float16 inputs multiply in their own dtype with float32 accumulation (P and dS
are rounded to the input dtype before their dots, as in FlashAttention-2); float32 inputs multiply
in full float32 (TF32 off).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashport.kernels.contract.spec import AttentionSpec, apply_softcap, positional_visible
from flashport.kernels.semantics import block_mask as block_mask_lib
from flashport.kernels.semantics import block_ranges, dropout
from flashport.kernels.semantics.padding import PaddedLengths, pad_to

MIN_BLOCK = 16  # Triton's smallest dot operand dimension


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Geometry(PaddedLengths):
    """Static tiling of one kernel: block sizes, padded lengths and block counts.

    ``bq`` / ``bk`` are the option's block sizes clipped to the (power-of-two rounded) sequence, so
    short sequences use one small block instead of a mostly padded large one.
    """

    spec: AttentionSpec
    bq: int
    bk: int
    # (score TracedMod, its array count, mask TracedMod, array shapes, class rows) or None: the user
    # mods the tiles run (kernels/semantics/mods.py); their arrays are kernel inputs named ``mod0``,
    # ``mod1``... Class rows: 0, or the batch rows (1 = shared) of the ``mod_classes`` input, the
    # mask_mod's block-mask class of every tile (:func:`mod_classes`).
    mods: Any = None

    @classmethod
    def make(cls, spec: AttentionSpec, block_q: int, block_k: int) -> Geometry:
        """Clip the requested blocks to the sequences (never below :data:`MIN_BLOCK`)."""
        bq = min(block_q, max(MIN_BLOCK, next_power_of_two(spec.seq_q)))
        bk = min(block_k, max(MIN_BLOCK, next_power_of_two(spec.seq_k)))
        return cls(spec, bq, bk)

    @property
    def nq(self) -> int:
        return -(-self.spec.seq_q // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.spec.seq_k // self.bk)


# The block-range builder's integer ops on traced int32 scalars (inputs are clamped >= 0 before div).
# Every op promotes Python ints weakly: under jax_enable_x64 a literal divisor would be int64, which
# lax.div rejects next to an int32 program id.
JAX_OPS = block_ranges.Ops(jnp.minimum, jnp.maximum, jnp.where, jnp.floor_divide)


def key_block_bounds(g: Geometry, i):
    """Half-open range of key blocks query block ``i`` (traced) must visit (:func:`block_ranges.key_blocks`)."""
    return block_ranges.key_blocks(g.spec, i, g.bq, g.bk, JAX_OPS)


def query_block_bounds(g: Geometry, j):
    """Half-open range of query blocks that may see key block ``j`` (traced) (:func:`block_ranges.query_blocks`)."""
    return block_ranges.query_blocks(g.spec, j, g.bq, g.bk, JAX_OPS)


def full_key_blocks(g: Geometry, i):
    """Key blocks every query of block ``i`` sees entirely (:func:`block_ranges.full_key_blocks`)."""
    return block_ranges.full_key_blocks(g.spec, i, g.bq, g.bk, JAX_OPS)


def full_query_blocks(g: Geometry, j):
    """Query blocks that see every key of block ``j`` (:func:`block_ranges.full_query_blocks`)."""
    return block_ranges.full_query_blocks(g.spec, j, g.bq, g.bk, JAX_OPS)


def split_loop(bounds, full, body, carry, visit=None, skip=None, classes=None):
    """``fori_loop`` over ``bounds`` = (lo, hi) calling ``body(n, carry, positional)``: tiles in the
    ``full`` range run with ``positional=False`` (no position masking), the rest with True.

    ``visit(n)`` (traced bool, optional) skips tile ``n`` when False: ``skip(n, carry)`` (default: the
    carry unchanged) runs instead, e.g. to write the zero gradient of a tile that is not computed.
    ``classes(n)`` (optional): tile ``n``'s class in the mask_mod's block mask; EMPTY tiles are
    skipped too, FULL ones run ``body(n, carry, positional, False)`` (no mask_mod test).
    """
    lo, hi = bounds
    f_lo = jnp.clip(full[0], lo, hi)
    f_hi = jnp.clip(full[1], f_lo, hi)

    def step(positional):
        def run(n, c):
            go = None if visit is None else visit(n)
            compute = lambda c: body(n, c, positional)  # noqa: E731
            if classes is not None:
                cls = classes(n)
                go = cls != block_mask_lib.EMPTY if go is None else go & (cls != block_mask_lib.EMPTY)
                compute = lambda c: jax.lax.cond(  # noqa: E731
                    cls == block_mask_lib.FULL,
                    lambda c: body(n, c, positional, False),
                    lambda c: body(n, c, positional, True),
                    c,
                )
            if go is None:
                return compute(c)
            pass_over = (lambda c: c) if skip is None else (lambda c: skip(n, c))
            return jax.lax.cond(go, compute, pass_over, c)

        return run

    carry = jax.lax.fori_loop(lo, f_lo, step(True), carry)
    carry = jax.lax.fori_loop(f_lo, f_hi, step(False), carry)
    return jax.lax.fori_loop(f_hi, hi, step(True), carry)


def mod_classes(g: Geometry, refs: dict, b, *, q_block=None, k_block=None):
    """``classes(n)`` for :func:`split_loop` over key blocks (``q_block`` given) or query blocks
    (``k_block`` given) of batch row ``b``, read from the ``mod_classes`` input; None without one."""
    if g.mods is None or not g.mods[4]:
        return None
    row = (b if g.mods[4] > 1 else 0) * g.nq
    table = refs["mod_classes"]
    if q_block is not None:
        return lambda j: table[(row + q_block) * g.nk + j]
    return lambda i: table[(row + i) * g.nk + k_block]


def mod_class_input(g: Geometry, blocks) -> jax.Array:
    """The ``mod_classes`` kernel input: int32 ``[(B or 1) * nq * nk]`` (padded to a power of two)."""
    table = block_mask_lib.tile_classes_over_heads(blocks, g.bq, g.bk).reshape(-1).astype(jnp.int32)
    return pad_to(table, 0, next_power_of_two(table.shape[0]))


def segment_visit(own, other):
    """Block skipping by segment ids: ``visit(n)`` for :func:`split_loop`, or None without segments.

    ``own`` is the int32 ids of the kernel's resident block (None: no segment ids) and ``other(n)`` the
    ids of block ``n`` of the other side. A tile whose two id ranges ``[min, max]`` do not intersect
    holds no pair with equal ids: everything in it is hidden, so it is skipped (exact, and a superset
    of the tiles that matter for any ids; for sorted ids, packed documents, it is the block diagonal).
    Padded positions carry id 0; they can only widen a range, never skip a visible tile.
    """
    if own is None:
        return None
    lo, hi = jnp.min(own), jnp.max(own)

    def visit(n):
        ids = other(n)
        return (jnp.max(ids) >= lo) & (jnp.min(ids) <= hi)

    return visit


# jax 0.10.2 moved Pallas' Triton tile product from jax.experimental.pallas to its triton module
# (same signature); the older place serves jax 0.10.0 and 0.10.1.
_triton_dot = getattr(plgpu, "dot", None) or pl.dot


def dot(a, b, *, trans_a=False, trans_b=False):
    """A float32-accumulating tile product; full float32 (no TF32) when the inputs are float32."""
    exact = a.dtype == jnp.float32 or b.dtype == jnp.float32
    return _triton_dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False if exact else None)


def fmix(x):
    """murmur3's 32-bit finalizer on uint32 arrays (the mixing step of the dropout hash)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(dropout.FMIX_M1)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(dropout.FMIX_M2)
    return x ^ (x >> 16)


def dropout_rows(seed, batch: int, heads: int, sqp: int):
    """``row_i`` of the dropout definition for every (batch, query head, query position): uint32
    [B, Hq, sqp], computed once in XLA (O(S)); the kernels finish the hash per key position."""
    t_bh = dropout.head_seed(seed, jnp.arange(batch)[:, None], jnp.arange(heads)[None, :])
    i = jnp.arange(sqp, dtype=jnp.uint32)
    return fmix(t_bh[..., None] + jnp.uint32(dropout.ROW_MUL) * (i + jnp.uint32(1)))


def tile_logits(
    g: Geometry,
    q,
    k,
    i,
    j,
    *,
    bias=None,
    mask=None,
    q_seg=None,
    kv_seg=None,
    positional=True,
    at=None,
    mask_mod=True,
):
    """Scores of tile (query block ``i``, key block ``j``) with every contract feature applied.

    Args:
      q: [bq, D] and k: [bk, D] in the input dtype.
      bias / mask: the tile's [bq|1, bk|1] slices (mask as int8) or None.
      q_seg: int32 [bq] and kv_seg: int32 [bk], or None.
      positional: apply causal/window/length masking; False for tiles in :func:`full_key_blocks`.
      at: ``(mod arrays, batch, query head)`` when the call has user mods (:func:`mod_arrays`).
      mask_mod: evaluate the mods' mask_mod; False for tiles its block mask marks full.

    Returns:
      ``(logits, raw)``: float32 [bq, bk] logits with hidden entries at -inf (positions past the
      true lengths included), and the scaled pre-softcap scores (the softcap gradient needs them).
    """
    spec = g.spec
    raw = dot(q, k, trans_b=True) * spec.scale
    logits = apply_softcap(spec, raw, jnp)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    visible = None
    if positional:
        q_pos = i * g.bq + jnp.arange(g.bq, dtype=jnp.int32)
        visible = positional_visible(spec, q_pos[:, None], key_positions(g, j)[None, :])
    if mask is not None:
        visible = (mask != 0) if visible is None else visible & (mask != 0)
    if q_seg is not None:
        same = q_seg[:, None] == kv_seg[None, :]
        visible = same if visible is None else visible & same
    if g.mods is not None and at is not None:
        mods, where = _mods(g, at), _indices(g, at, i, j)
        logits = mods.apply_score(logits, *where)
        seen = mods.visible(*where) if mask_mod else None
        if seen is not None:
            visible = seen if visible is None else visible & seen
    return (logits if visible is None else jnp.where(visible, logits, -jnp.inf)), raw


def mod_arrays(g: Geometry, refs: dict) -> tuple:
    """The user mods' arrays read from the kernel's ``mod<n>`` inputs, in their own shapes."""
    if g.mods is None:
        return ()
    shapes = g.mods[3]
    return tuple(refs[f"mod{n}"][...].reshape(shape) for n, shape in enumerate(shapes))


def _mods(g: Geometry, at):
    from flashport.kernels.semantics.mods import Mods

    score, n_score, mask = g.mods[:3]
    consts = at[0]
    return Mods(score, consts[:n_score], mask, consts[n_score:])


def _indices(g: Geometry, at, i, j):
    q_pos = i * g.bq + jnp.arange(g.bq, dtype=jnp.int32)
    return at[1], at[2], q_pos[:, None], key_positions(g, j)[None, :]


def mod_grad(g: Geometry, raw, bias, i, j, at):
    """d score_mod / d score over tile (i, j) (``None`` without a score_mod)."""
    if g.mods is None or g.mods[0] is None or at is None:
        return None
    pre = apply_softcap(g.spec, raw, jnp)
    if bias is not None:
        pre = pre + bias.astype(jnp.float32)
    return _mods(g, at).score_derivative(pre, *_indices(g, at, i, j))


def key_positions(g: Geometry, j):
    """int32 [bk]: the absolute positions of key block ``j``."""
    return j * g.bk + jnp.arange(g.bk, dtype=jnp.int32)


def apply_dropout(g: Geometry, x, rows, j):
    """``x`` [bq, bk] with the contract's dropout (kept entries scaled by 1/(1-rate)).

    ``rows`` are the uint32 [bq] row hashes of :func:`dropout_rows`; None means no dropout.
    """
    if rows is None:
        return x
    rate = g.spec.dropout_rate
    cols = jnp.uint32(dropout.KEY_MUL) * (key_positions(g, j).astype(jnp.uint32) + jnp.uint32(1))
    keep = fmix(rows[:, None] ^ cols[None, :]) >= jnp.uint32(dropout.threshold(rate))
    return jnp.where(keep, x * (1.0 / (1.0 - rate)), 0.0)
