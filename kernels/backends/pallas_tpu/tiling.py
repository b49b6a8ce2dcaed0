"""Static tiling, padding and block-skip tables shared by the Pallas TPU attention kernels.

A kernel covers a padded [Sqp, Skp] score matrix with [bq, bk] tiles. For every row block i the
causal/window structure leaves a contiguous range of visible key blocks ``[lo_i, hi_i)`` (static,
from :func:`flashport.kernels.semantics.block_ranges.block_tables`); the kernels' key axis only has ``max_i(hi_i - lo_i)`` steps
("grid shrinking") and step j of row i visits block ``lo_i + j``. Steps past ``hi_i`` are clamped to
the last visited block, so the pipeline sees an unchanged block index and issues no DMA, and the
compute is skipped with ``pl.when``. Segment ids narrow the ranges further at run time: per-block
min/max ids (computed in XLA, O(S)) drop blocks whose id intervals do not overlap.

The ranges travel to the kernel as scalar-prefetch tables in SMEM (int32, flattened
``[batch_or_1 * n_blocks]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashport.kernels.backends.pallas_tpu.blocks import K_ALIGN, LANES, Q_ALIGN, SHORT_Q_ALIGN
from flashport.kernels.contract.spec import AttentionSpec, apply_softcap
from flashport.kernels.semantics import block_mask as block_mask_lib
from flashport.kernels.semantics import block_ranges, dropout
from flashport.kernels.semantics.padding import PaddedLengths, pad_broadcastable, pad_to
from flashport.kernels.semantics.visibility import band_visible

_BIG = np.iinfo(np.int32).max


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is >= ``x`` (and >= m)."""
    return max(m, -(-x // m) * m)


@dataclasses.dataclass(frozen=True)
class Geometry(PaddedLengths):
    """Block geometry of one kernel: tile sizes, padded sizes and the static visible block ranges.

    ``rows`` are query blocks and ``cols`` key blocks. ``row_lo/row_hi[i]`` is the half-open range of
    key blocks row block i may see; ``col_lo/col_hi[j]`` the range of query blocks that may see key
    block j. ``steps_k``/``steps_q`` are the shrunken grid extents.
    """

    spec: AttentionSpec
    bq: int
    bk: int
    row_lo: tuple[int, ...]
    row_hi: tuple[int, ...]
    col_lo: tuple[int, ...]
    col_hi: tuple[int, ...]
    # (score TracedMod, number of its closed-over arrays, mask TracedMod, block mask given) or None:
    # the user mods the tiles run (kernels/mods.py); their arrays travel in ``Tables.mod_consts``,
    # the tile classes of the mask_mod's block mask in ``Tables.mod_classes``.
    mods: Any = None
    # Kv heads per grid step of the heads-major forward (its query heads: head_block * G), from
    # :func:`~flashport.kernels.backends.pallas_tpu.blocks.fit_head_block`; 1 elsewhere.
    head_block: int = 1

    @property
    def has_mask_mod(self) -> bool:
        """Whether a ``mask_mod`` hides entries."""
        return self.mods is not None and self.mods[2] is not None

    @property
    def mask_mod_classified(self) -> bool:
        """Whether the ``mask_mod`` comes with a block mask: its empty tiles are skipped and its full
        tiles may take the mask-free body (without one, every tile takes the masked body)."""
        return self.has_mask_mod and bool(self.mods[3])

    @staticmethod
    def make(spec: AttentionSpec, block_q: int, block_k: int) -> Geometry:
        """Clip the blocks to the sequence lengths and compute the static ranges.

        A query shorter than ``Q_ALIGN`` rows is one block of ``round_up(seq_q, SHORT_Q_ALIGN)`` rows.
        """
        q_align = SHORT_Q_ALIGN if spec.seq_q < Q_ALIGN else Q_ALIGN
        bq = min(block_q, round_up(spec.seq_q, q_align))
        bk = min(block_k, round_up(spec.seq_k, K_ALIGN))
        t = block_ranges.block_tables(spec, bq, bk)
        return Geometry(spec, bq, bk, t.row_lo, t.row_hi, t.col_lo, t.col_hi)

    @property
    def nq(self) -> int:
        """Number of query blocks."""
        return len(self.row_lo)

    @property
    def nk(self) -> int:
        """Number of key blocks."""
        return len(self.col_lo)

    @property
    def steps_k(self) -> int:
        """Grid extent of the key axis in row-major kernels (forward, dQ): the widest row."""
        return max(1, max(h - l for l, h in zip(self.row_lo, self.row_hi, strict=False)))

    @property
    def steps_q(self) -> int:
        """Grid extent of the query axis in the column-major kernel (dK/dV): the tallest column."""
        return max(1, max(h - l for l, h in zip(self.col_lo, self.col_hi, strict=False)))

    @property
    def visited_tiles(self) -> int:
        """Tiles the row-major kernels compute per (batch, head) without segment ids."""
        return sum(h - l for l, h in zip(self.row_lo, self.row_hi, strict=False))

    @property
    def needs_position_mask(self) -> bool:
        """Whether tiles must compare positions (causal/window, or keys padded past ``seq_k``)."""
        return self.spec.has_positional_mask or self.skp != self.spec.seq_k


def pad_lanes(x):
    """Pad the last (head_dim) axis to a multiple of 128 lanes; zeros leave Q·Kᵀ and P·V unchanged."""
    return pad_to(x, x.ndim - 1, round_up(x.shape[-1], LANES))


def prepare_operands(g: Geometry, bias, mask, q_seg, kv_seg):
    """Pad bias/mask (only their non-broadcast sequence dims) and lay out segment ids for the kernels.

    Returns ``(bias, mask_int8, q_seg [B, Sqp, 1], kv_seg [B, 1, Skp])`` (``None`` where absent).
    """
    bias = pad_broadcastable(bias, {2: g.sqp, 3: g.skp})
    if mask is not None:
        mask = pad_broadcastable(mask.astype(jnp.int8), {2: g.sqp, 3: g.skp})  # Mosaic: no bool memrefs
    if q_seg is not None:
        q_seg = pad_to(q_seg, 1, g.sqp)[:, :, None]
        kv_seg = pad_to(kv_seg, 1, g.skp)[:, None, :]
    return bias, mask, q_seg, kv_seg


def _block_minmax(seg, true_len, block, n):
    """Per-block min and max segment id over the true (unpadded) positions: two [B, n] arrays."""
    b = seg.shape[0]
    valid = jnp.arange(n * block) < true_len
    seg = pad_to(seg, 1, n * block)
    lo = jnp.where(valid, seg, _BIG).reshape(b, n, block).min(-1)
    hi = jnp.where(valid, seg, -_BIG).reshape(b, n, block).max(-1)
    return lo, hi


class Tables(NamedTuple):
    """The scalar-prefetch tables (SMEM) of one kernel call; absent tables are ``None``.

    ``lo``/``hi``: int32 visited block range per resident block, [n] without segment ids, else
    [B * n] (narrowed to the blocks whose segment-id intervals overlap). ``q_min``/``q_max`` [B * nq]
    and ``k_min``/``k_max`` [B * nk]: per-block segment-id intervals (segment ids only).
    ``head_seeds``: uint32 [B * Hq] dropout seeds ``t_bh`` (dropout only). ``full_lo``/``full_hi``
    int32 [nq]: per query block, the key blocks whose tiles are fully visible (see
    :mod:`~flashport.kernels.backends.pallas_tpu.classify`; ``None``: classify nothing). Passed to ``pallas_call``
    as one scalar-prefetch argument, so index maps and kernels receive a ``Tables`` of refs.
    """

    lo: Any
    hi: Any
    q_min: Any = None
    q_max: Any = None
    k_min: Any = None
    k_max: Any = None
    head_seeds: Any = None
    full_lo: Any = None
    full_hi: Any = None
    # int32 [n_rows * steps], without segment ids: per (resident block, step) the streamed block to
    # visit and the tile's class in one word (see :func:`with_step_codes`); None: computed from lo/hi.
    step_code: Any = None
    mod_consts: Any = None  # the arrays the score_mod then the mask_mod close over (Geometry.mods)
    # int32 [(B or 1) * nq * nk]: the mask_mod's class of each tile (block_mask EMPTY / PARTIAL /
    # FULL, one class for all heads; see mod_class_table), or None.
    mod_classes: Any = None

    @property
    def segmented(self) -> bool:
        """Whether the ranges are per batch row (segment ids given)."""
        return self.q_min is not None


def block_tables(g: Geometry, q_seg, kv_seg, *, by_rows: bool) -> Tables:
    """Block-range :class:`Tables`: the visited block range per row (``by_rows``) or per column block.

    Without segment ids: the static ranges. With them: ranges flattened over the batch and narrowed
    to the first and last block whose id interval overlaps, plus the per-block id intervals the
    kernels use to skip non-overlapping blocks inside the range.
    """
    if by_rows:
        lo_s, hi_s = np.asarray(g.row_lo, np.int32), np.asarray(g.row_hi, np.int32)
    else:
        lo_s, hi_s = np.asarray(g.col_lo, np.int32), np.asarray(g.col_hi, np.int32)
    if q_seg is None:
        return Tables(jnp.asarray(lo_s), jnp.asarray(hi_s))
    q_min, q_max = _block_minmax(q_seg, g.spec.seq_q, g.bq, g.nq)
    k_min, k_max = _block_minmax(kv_seg, g.spec.seq_k, g.bk, g.nk)
    # overlap[b, i, j]: some query id of row block i may equal some key id of column block j.
    overlap = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
    if not by_rows:
        overlap = jnp.swapaxes(overlap, 1, 2)
    n_other = overlap.shape[2]
    idx = jnp.arange(n_other)
    in_range = (idx[None, :] >= lo_s[:, None]) & (idx[None, :] < hi_s[:, None])
    ok = overlap & in_range[None]
    any_ok = ok.any(-1)
    lo = jnp.where(any_ok, jnp.argmax(ok, -1), lo_s[None, :])
    hi = jnp.where(any_ok, n_other - jnp.argmax(ok[..., ::-1], -1), lo_s[None, :])
    flat = lambda x: x.reshape(-1).astype(jnp.int32)  # noqa: E731
    return Tables(flat(lo), flat(hi), flat(q_min), flat(q_max), flat(k_min), flat(k_max))


def visited_count(g: Geometry, q_seg=None, kv_seg=None) -> int:
    """Tiles the row-major kernels compute, summed over the batch (1 batch row without segments)."""
    tables = block_tables(g, q_seg, kv_seg, by_rows=True)
    lo, hi = np.asarray(tables.lo), np.asarray(tables.hi)
    if q_seg is None:
        return int(np.sum(hi - lo))
    q_min, q_max = np.asarray(tables.q_min), np.asarray(tables.q_max)
    k_min, k_max = np.asarray(tables.k_min), np.asarray(tables.k_max)
    b = q_seg.shape[0]
    total = 0
    for bi in range(b):
        for i in range(g.nq):
            r = bi * g.nq + i
            for j in range(lo[r], hi[r]):
                c = bi * g.nk + j
                total += int(q_min[r] <= k_max[c] and k_min[c] <= q_max[r])
    return total


class Step:
    """Scalar logic of one grid step, shared by index maps and kernel bodies.

    ``row`` is the resident block (query block for forward/dQ, key block for dK/dV), ``step`` the
    position along the streamed axis; ``tables`` is the call's :class:`Tables` (of refs in a kernel).
    """

    def __init__(self, tables: Tables, b, row, step, n_rows, n_cols, by_rows):
        segmented = tables.segmented
        self.full = None  # scalar "tile fully visible" when the step codes carry it
        self._count = None
        self._tables, self._base = tables, (b * n_rows + row if segmented else row)
        if tables.step_code is not None and not segmented:
            # One scalar load per step instead of a dependent chain of loads, clamps and selects: the
            # chain sat on every grid step's critical path (index maps and kernel alike).
            code = tables.step_code[row * (tables.step_code.shape[0] // n_rows) + step]
            self.block = jnp.right_shift(code, STEP_CODE_BITS)
            cls = jnp.bitwise_and(code, STEP_CLASS_MASK)
            self.run = cls != STEP_SKIP
            self.full = cls == STEP_FULL
            return
        base = b * n_rows + row if segmented else row
        lo, hi = tables.lo[base], tables.hi[base]
        self._count = hi - lo
        # Clamp to the last visited block (or lo, for an empty range): an unchanged index means no DMA.
        self.block = jnp.minimum(lo + jnp.minimum(step, jnp.maximum(self._count - 1, 0)), n_cols - 1)
        self.run = step < self._count
        if segmented:
            other = b * n_cols + self.block
            qi, kj = (base, other) if by_rows else (other, base)
            t = tables
            overlap = jnp.logical_and(t.q_min[qi] <= t.k_max[kj], t.k_min[kj] <= t.q_max[qi])
            self.run = jnp.logical_and(self.run, overlap)
        if tables.mod_classes is not None:  # the mask_mod hides every entry of an EMPTY tile
            q_block, k_block = (row, self.block) if by_rows else (self.block, row)
            n_q, n_k = (n_rows, n_cols) if by_rows else (n_cols, n_rows)
            cls = mod_class(tables, b, q_block, k_block, n_q, n_k)
            self.run = jnp.logical_and(self.run, cls != block_mask_lib.EMPTY)

    @property
    def count(self):
        """Blocks the resident block visits along the streamed axis."""
        if self._count is None:
            self._count = self._tables.hi[self._base] - self._tables.lo[self._base]
        return self._count


def mod_class_table(g: Geometry, blocks) -> jax.Array:
    """The mask_mod's tile classes at ``g``'s tiles from its block mask ``blocks``, flattened for
    SMEM: int32 ``[(B or 1) * nq * nk]``; a tile is empty (full) when it is for every head."""
    return block_mask_lib.tile_classes_over_heads(blocks, g.bq, g.bk).reshape(-1).astype(jnp.int32)


def mod_class(tables: Tables, b, q_block, k_block, nq: int, nk: int):
    """In-kernel scalar: the mask_mod's class of tile (``q_block``, ``k_block``) of batch row ``b``."""
    per_batch = tables.mod_classes.shape[0] != nq * nk
    return tables.mod_classes[((b if per_batch else 0) * nq + q_block) * nk + k_block]


# Step codes (Tables.step_code): ``block << STEP_CODE_BITS | class``.
STEP_CODE_BITS = 2
STEP_CLASS_MASK = 3
STEP_SKIP, STEP_PARTIAL, STEP_FULL = 0, 1, 2


def load(ref):
    """``ref[...]``, or ``None`` for an absent (``None``) optional operand."""
    return None if ref is None else ref[...]


def tile_shape(g: Geometry, key_major: bool = False) -> tuple[int, int]:
    """Shape of one score tile: [bq, bk], or [bk, bq] for a key-major tile (keys along the rows)."""
    return (g.bk, g.bq) if key_major else (g.bq, g.bk)


def tile_visible(
    g: Geometry, qi, kj, mask_tile=None, q_seg_tile=None, kv_seg_tile=None, at=None, key_major=False
):
    """In-kernel boolean [bq, bk] (or ``None`` = all visible) for query block ``qi``, key block ``kj``.

    Positions come from 2-D iotas; keys past ``seq_k`` and causal/window structure are hidden; the
    mask tile (int8, broadcastable, [bq, bk] orientation) and segment id tiles ([bq, 1] vs [1, bk], or
    [1, bq] vs [bk, 1] key-major) are applied if given, and the ``mask_mod`` of ``g.mods`` at ``at``
    (:func:`mod_site`). ``key_major``: the [bk, bq] tile of :func:`tile_shape`.
    """
    spec = g.spec
    vis = None
    shape = tile_shape(g, key_major)
    q_axis, k_axis = (1, 0) if key_major else (0, 1)

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if g.needs_position_mask:
        k_pos = kj * g.bk + jax.lax.broadcasted_iota(jnp.int32, shape, k_axis)
        vis = k_pos < spec.seq_k if g.skp != spec.seq_k else None
        if spec.has_positional_mask:
            diag = qi * g.bq + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis) + spec.offset
            vis = band_visible(
                diag, k_pos, causal=spec.causal, left=spec.window_left, right=spec.window_right, visible=vis
            )
    if mask_tile is not None:
        # Widened to 32 bits: an int8 compare gives a boolean in int8's (32, 128) vreg layout, which
        # Mosaic cannot relayout to select over f32 scores; and it transposes 32-bit tiles only.
        mask_tile = mask_tile.astype(jnp.int32)
        mask_tile = mask_tile.T if key_major else mask_tile
        vis = both(vis, jnp.broadcast_to(mask_tile != 0, shape))
    if q_seg_tile is not None:
        vis = both(vis, q_seg_tile == kv_seg_tile)
    if g.has_mask_mod and at is not None:
        vis = both(vis, _mods(g, at).visible(*_indices(g, at, key_major)))
    return vis


def mod_site(tables, batch, head, qi, kj):
    """Where a tile sits, for the user mods: ``(tables, batch, query head, q block, k block)``."""
    return (tables, batch, head, qi, kj)


def _mods(g: Geometry, at):
    """The call's :class:`~flashport.kernels.semantics.mods.Mods` with their arrays read from the tables."""
    from flashport.kernels.semantics.mods import Mods

    score, n_score, mask = g.mods[:3]
    consts = [ref[...] for ref in at[0].mod_consts]
    return Mods(score, consts[:n_score], mask, consts[n_score:])


def _indices(g: Geometry, at, key_major=False):
    """Batch, query head (scalars), query rows [bq, 1] and key columns [1, bk] of the tile ``at``
    (key-major: query positions [1, bq] and keys [bk, 1], so that they broadcast to [bk, bq])."""
    _, batch, head, qi, kj = at
    q_shape, k_shape, q_axis, k_axis = (
        ((1, g.bq), (g.bk, 1), 1, 0) if key_major else ((g.bq, 1), (1, g.bk), 0, 1)
    )
    rows = qi * g.bq + jax.lax.broadcasted_iota(jnp.int32, q_shape, q_axis)
    cols = kj * g.bk + jax.lax.broadcasted_iota(jnp.int32, k_shape, k_axis)
    return batch, head, rows, cols


def _pre_mod(g: Geometry, raw, bias_tile):
    s = apply_softcap(g.spec, raw, jnp)
    return s if bias_tile is None else s + bias_tile


def scores(g: Geometry, q, k, bias_tile, at=None, key_major=False):
    """Scaled (and soft-capped, biased, score_mod-ed at ``at``) f32 scores [bq, bk] of one tile plus
    the pre-softcap ``raw``; ``key_major``: the [bk, bq] tile (K·Qᵀ; ``bias_tile`` oriented alike)."""
    a, b = (k, q) if key_major else (q, k)
    raw = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    raw = raw * g.spec.scale
    s = _pre_mod(g, raw, bias_tile)
    if g.mods is not None and g.mods[0] is not None and at is not None:
        s = _mods(g, at).apply_score(s, *_indices(g, at, key_major))
    return s, raw


def mod_grad(g: Geometry, raw, bias_tile, at, key_major=False):
    """d score_mod / d score over the tile (``None`` without a score_mod)."""
    if g.mods is None or g.mods[0] is None or at is None:
        return None
    return _mods(g, at).score_derivative(_pre_mod(g, raw, bias_tile), *_indices(g, at, key_major))


LOG2_E = 1.4426950408889634


def folds_scale(g: Geometry, has_bias: bool) -> bool:
    """Whether a kernel may keep its scores unscaled and fold ``scale`` into a base-2 exponent
    (``exp(scale * (raw - m)) = exp2(scale * log2(e) * (raw - m))``): one multiply per score fewer.
    Only without softcap, bias and a score_mod, which act on the scaled scores."""
    return g.spec.softcap is None and not has_bias and (g.mods is None or g.mods[0] is None)


def tile_keep(g: Geometry, head_seed, qi, kj, key_major=False):
    """In-kernel dropout keep-mask [bq, bk] (key-major: [bk, bq]) of query block ``qi`` x key block ``kj``
    (``None``: no dropout).

    ``head_seed`` is the uint32 scalar ``t_bh`` of the tile's (global) batch and query head, read from
    the scalar-prefetch table. Positions are absolute (query and key axes are never sharded), so the
    mask is :func:`flashport.kernels.semantics.dropout.keep_mask` itself, whatever the block sizes and
    orientation: the row hash is computed once per query position and combined with each key.
    """
    if g.spec.dropout_rate == 0:
        return None
    _, _, rows, cols = _indices(g, (None, None, None, qi, kj), key_major)
    return dropout.keep_mask(g.spec.dropout_rate, head_seed, rows, cols)


def head_seed_table(seed, batch: int, heads: int):
    """``t_bh`` for every (batch, query head): uint32 [B, Hq] (the kernels read it flattened from SMEM)."""
    return dropout.head_seed(seed, jnp.arange(batch)[:, None], jnp.arange(heads)[None, :])


def analytic_causal_fraction(n: int) -> float:
    """Fraction of tiles a causal square n×n block grid visits: (n+1)/2n."""
    return (n + 1) / (2 * n)
