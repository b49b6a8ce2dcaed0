"""Block sparsity from a ``mask_mod``: which (query block, key block) tiles are empty, partial or full.

:func:`block_mask` evaluates a ``mask_mod`` over every position once, ahead of the attention call,
and keeps one class per tile (FlexAttention's ``create_block_mask``, splash attention's mask info):

* ``EMPTY``: no query of the block sees any key of the block; kernels skip the tile;
* ``FULL``: every query sees every key; kernels drop the ``mask_mod`` test there;
* ``PARTIAL``: kernels evaluate the ``mask_mod`` on the tile.

The classes are an int8 array ``[B|1, H|1, nq, nk]`` (1 where the ``mask_mod`` ignores the batch or
head index), so a :class:`BlockMask` is a pytree that works under ``jit``, ``grad`` and ``vmap`` and
may be built from traced document ids. Kernels whose tiles are multiples of the mask's blocks regroup
the classes with :func:`tile_classes` (a tile is empty when every block it covers is, full when every
one is); finer tiles are classified afresh from the ``mask_mod``. ``flashport.attention`` given only a ``mask_mod`` builds one itself, cached per shape and
closed-over values when those are concrete (:func:`cached_block_mask`).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashport.kernels.semantics import mods as mods_lib

EMPTY, PARTIAL, FULL = 0, 1, 2
# FlexAttention's default block size (both sides).
DEFAULT_BLOCK = 128
# Block masks flashport built itself and keeps (least recently used dropped first).
MAX_CACHED = 32


@jax.tree_util.register_pytree_node_class
class BlockMask:
    """Per-tile classes of one ``mask_mod`` at one shape (see the module docstring).

    Attributes:
      classes: int8 ``[B|1, H|1, nq, nk]`` of ``EMPTY`` / ``PARTIAL`` / ``FULL``.
      shape: ``(B|None, H|None, Sq, Sk)`` as built (None: any batch / head count).
      block_size: ``(block_q, block_k)``.
      mod / consts: the traced ``mask_mod`` and the arrays it closes over.
    """

    def __init__(self, mod, consts, classes, shape, block_size):
        self.mod, self.consts, self.classes = mod, tuple(consts), classes
        self.shape, self.block_size = tuple(shape), tuple(block_size)

    def tree_flatten(self):
        return (self.consts, self.classes), (self.mod, self.shape, self.block_size)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], children[0], children[1], aux[1], aux[2])

    def mask_mod(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        """The ``mask_mod`` this block mask was built from (FlexAttention's ``BlockMask.mask_mod``)."""
        return self.mod(self.consts, batch, head, q_idx, kv_idx)

    @property
    def kv_num_blocks(self) -> jax.Array:
        """Per query block, how many key blocks are partial (FlexAttention's ``kv_num_blocks``)."""
        return jnp.sum(self.classes == PARTIAL, axis=-1, dtype=jnp.int32)

    @property
    def full_kv_num_blocks(self) -> jax.Array:
        """Per query block, how many key blocks are full (FlexAttention's ``full_kv_num_blocks``)."""
        return jnp.sum(self.classes == FULL, axis=-1, dtype=jnp.int32)

    def sparsity(self) -> float:
        """Percentage of tiles that are empty (FlexAttention's ``BlockMask.sparsity()``)."""
        return float(100.0 * jnp.mean(self.classes == EMPTY))

    def __repr__(self) -> str:
        return f"BlockMask(shape={self.shape}, block_size={self.block_size}, classes={self.classes.shape})"


def block_mask(
    mask_mod: Any,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    *,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK,
) -> BlockMask:
    """Evaluate ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` over every position and classify
    each ``BLOCK_SIZE`` tile; pass the result as ``flashport.attention(..., block_mask=...)``.

    ``B`` / ``H`` = None (FlexAttention's convention) build one row for every batch / head; then the
    ``mask_mod`` must not read that index. The arrays the ``mask_mod`` closes over may be traced.

    Raises:
      TypeError / ValueError naming the argument (a non-bool mask_mod, bad sizes, a ``None`` batch
      or head that the mask_mod reads).
    """
    traced, consts = mods_lib.trace(mask_mod, "mask_mod")
    bq, bk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("BLOCK_SIZE", bq), ("BLOCK_SIZE", bk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    reads = reads_indices(traced)
    for name, size, index in (("B", B, 0), ("H", H, 1)):
        if size is None and reads[index]:
            raise ValueError(
                f"{name}=None builds one block row for all, but this mask_mod reads the "
                f"{('batch', 'head')[index]} index; pass {name}"
            )
    return build(traced, consts, B, H, int(Q_LEN), int(KV_LEN), (int(bq), int(bk)))


def reads_indices(traced: mods_lib.TracedMod) -> tuple[bool, bool, bool, bool]:
    """Which of (batch, head, q_idx, kv_idx) the traced mask_mod's result depends on at all."""
    jaxpr = traced.jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return tuple(id(v) in used for v in jaxpr.invars)  # type: ignore[return-value]


def build(
    traced: mods_lib.TracedMod,
    consts: tuple,
    batch: int | None,
    heads: int | None,
    sq: int,
    sk: int,
    block_size: tuple[int, int],
) -> BlockMask:
    """The :class:`BlockMask` of ``traced`` at one shape (no checks; see :func:`block_mask`)."""
    bq, bk = block_size
    nq, nk = -(-sq // bq), -(-sk // bk)
    reads = reads_indices(traced)
    rows_b = batch if (batch is not None and reads[0]) else 1
    rows_h = heads if (heads is not None and reads[1]) else 1
    b = jnp.arange(rows_b, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(rows_h, dtype=jnp.int32)[None, :, None, None]
    k = jnp.arange(nk * bk, dtype=jnp.int32)
    k_valid = k < sk
    mods = mods_lib.Mods(mask=traced, mask_consts=consts)

    def row(i):
        q = i * bq + jnp.arange(bq, dtype=jnp.int32)
        seen = mods.visible(b, h, q[:, None], k[None, :])
        valid = (q < sq)[:, None] & k_valid[None, :]
        seen = jnp.broadcast_to(seen, (rows_b, rows_h, bq, nk * bk)).reshape(rows_b, rows_h, bq, nk, bk)
        valid = valid.reshape(bq, nk, bk)
        any_seen = jnp.any(seen & valid[:, :, :], axis=(2, 4))
        all_seen = jnp.all(seen | ~valid, axis=(2, 4))
        return jnp.where(any_seen, jnp.where(all_seen, FULL, PARTIAL), EMPTY).astype(jnp.int8)

    classes = jax.lax.map(row, jnp.arange(nq))  # [nq, B, H, nk]
    return BlockMask(traced, consts, jnp.moveaxis(classes, 0, 2), (batch, heads, sq, sk), (bq, bk))


def check_for_call(blocks: BlockMask, batch: int, heads: int, sq: int, sk: int) -> None:
    """Raise ValueError when ``blocks`` was built for another shape than the call's [B, Hq, Sq, Sk]."""
    b, h, bsq, bsk = blocks.shape
    if (bsq, bsk) != (sq, sk) or b not in (None, batch) or h not in (None, heads):
        raise ValueError(
            f"block_mask was built for (B, H, Q_LEN, KV_LEN) = {blocks.shape}, but the call has "
            f"{(batch, heads, sq, sk)}; build it with flashport.block_mask for this shape"
        )


_CACHE: collections.OrderedDict = collections.OrderedDict()


def cached_block_mask(
    traced: mods_lib.TracedMod, consts: tuple, batch: int, heads: int, sq: int, sk: int
) -> BlockMask:
    """The block mask ``flashport.attention`` builds for a bare ``mask_mod``: reused across calls
    while the shape and the closed-over values are the same (only when those are concrete; traced
    ones are classified inside the trace, every call)."""
    if any(isinstance(c, jax.core.Tracer) for c in consts):
        return build(traced, consts, batch, heads, sq, sk, (DEFAULT_BLOCK, DEFAULT_BLOCK))
    digest = hashlib.sha256()
    for c in consts:
        arr = np.asarray(c)
        digest.update(f"{arr.shape}{arr.dtype}".encode())
        digest.update(arr.tobytes())
    key = (traced, batch, heads, sq, sk, digest.hexdigest())
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    with jax.ensure_compile_time_eval():  # concrete classes, even when called under a jit trace
        built = build(traced, consts, batch, heads, sq, sk, (DEFAULT_BLOCK, DEFAULT_BLOCK))
    _CACHE[key] = built
    while len(_CACHE) > MAX_CACHED:
        _CACHE.popitem(last=False)
    return built


def _overlap(n_tiles: int, tile: int, n_blocks: int, block: int, length: int) -> np.ndarray:
    """float32 [n_tiles, n_blocks]: 1 where tile t's positions (within ``length``) meet block m's."""
    out = np.zeros((n_tiles, n_blocks), np.float32)
    for t in range(n_tiles):
        lo, hi = t * tile, min((t + 1) * tile, length)
        if lo < hi:
            out[t, lo // block : -(-hi // block)] = 1.0
    return out


def tile_classes(blocks: BlockMask, tile_q: int, tile_k: int, *, per_head: bool = True) -> jax.Array:
    """``blocks``' classes regrouped for tiles of ``tile_q`` x ``tile_k``: int8 ``[B|1, H|1, nq, nk]``
    (``per_head=False``: ``[nq, nk]``, one class for all batches and heads, as kernels that compute
    every head in one tile need). Tiles past the lengths (padding) are empty."""
    _, _, sq, sk = blocks.shape
    bq, bk = blocks.block_size
    nq, nk = -(-sq // tile_q), -(-sk // tile_k)
    classes = blocks.classes
    if tile_q % bq or tile_k % bk:  # tiles finer than (or across) the blocks: classify them afresh
        classes = build(blocks.mod, blocks.consts, blocks.shape[0], blocks.shape[1], sq, sk, (tile_q, tile_k))
        classes = classes.classes
    elif (tile_q, tile_k) != (bq, bk):
        oq = jnp.asarray(_overlap(nq, tile_q, classes.shape[2], bq, sq))
        ok = jnp.asarray(_overlap(nk, tile_k, classes.shape[3], bk, sk))
        seen = jnp.einsum("tm,bhmn,sn->bhts", oq, (classes != EMPTY).astype(jnp.float32), ok) > 0
        partial = jnp.einsum("tm,bhmn,sn->bhts", oq, (classes != FULL).astype(jnp.float32), ok) > 0
        classes = jnp.where(seen, jnp.where(partial, PARTIAL, FULL), EMPTY).astype(jnp.int8)
    if per_head:
        return classes
    seen = jnp.any(classes != EMPTY, axis=(0, 1))
    full = jnp.all(classes == FULL, axis=(0, 1))
    return jnp.where(seen, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int8)


def tile_classes_over_heads(blocks: BlockMask, tile_q: int, tile_k: int) -> jax.Array:
    """:func:`tile_classes` with one class for all heads, per batch row: int8 ``[B|1, nq, nk]`` (a
    tile is empty when it is for every head, full when it is for every head), what kernels whose
    grid steps serve several heads skip and classify by."""
    classes = tile_classes(blocks, tile_q, tile_k)
    seen = jnp.any(classes != EMPTY, axis=1)
    full = jnp.all(classes == FULL, axis=1)
    return jnp.where(seen, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int8)
