"""Per-tile classification of the Pallas TPU kernels: skip, fully visible or partial.

Every (query block, key block) tile a kernel could visit falls in one of three classes (splash
attention's ``block_mask`` 0/2/1):

* **skip**: nothing in it is visible. The block-range tables of
  :mod:`~flashport.kernels.backends.pallas_tpu.tiling` already leave these out of the grid (or skip them by
  their segment-id intervals).
* **full**: every (real query, key) pair of the tile is visible. The kernel runs a body without any
  mask computation (no iota, compare or select over the ``[bq, bk]`` tile).
* **partial**: the rest; the kernel runs the masked body.

A tile is full when (1) causal/window structure keeps every pair of the tile and no key of it is
padding (static: per query block, the full key blocks form one contiguous range
``[full_lo_i, full_hi_i)``, computed here), (2) with segment ids, every real query and key of the tile
carries one and the same id (run time: the per-block min/max ids of the tables are all equal), and
(3) no ``mask`` array is given (a mask is always tested element-wise), and (4) with a ``mask_mod``,
its block mask marks the tile FULL (run time: ``Tables.mod_classes``, also read to skip the tiles
it marks EMPTY; a ``mask_mod`` without a block mask makes every tile partial). Padded query rows never
matter: their outputs are sliced off and their (zero) ``dO`` adds nothing to dK/dV.

The full ranges travel as two more scalar-prefetch tables (``Tables.full_lo``/``full_hi``, int32
[nq]), indexed by the query block in all three kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from flashport.kernels.backends.pallas_tpu.tiling import (
    STEP_CODE_BITS,
    STEP_FULL,
    STEP_PARTIAL,
    STEP_SKIP,
    Geometry,
    Tables,
    mod_class,
)
from flashport.kernels.semantics import block_mask as block_mask_lib
from flashport.kernels.semantics import block_ranges

# Named scopes of the kernels' tile bodies; the counting harness (``counting.py``) finds the mask
# operations of each class in a kernel's jaxpr by them. Inside a body, the online-softmax update and
# dropout have their own scopes (they are not masking).
FULL_SCOPE = "flashport_full_tile"
PARTIAL_SCOPE = "flashport_partial_tile"
SOFTMAX_SCOPE = "flashport_online_softmax"
DROPOUT_SCOPE = "flashport_dropout"
UNCOUNTED_SCOPES = (SOFTMAX_SCOPE, DROPOUT_SCOPE)


def full_block_ranges(g: Geometry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per query block i, the half-open range of key blocks whose every pair is visible.

    Keys are positionally visible to all real rows of block i from the largest lower bound (the last
    row's) to the smallest upper bound (the first row's); a full key block lies inside that range
    and ends at or before ``seq_k`` (no padding). An empty range is returned as ``(lo, lo)``.
    """
    spec = g.spec
    lo_out, hi_out = [], []
    for i in range(g.nq):
        q0, q1 = i * g.bq, min((i + 1) * g.bq, spec.seq_q)
        lo_pos = block_ranges.key_range(spec, q1 - 1, q1)[0]
        hi_pos = min(block_ranges.key_range(spec, q0, q0 + 1)[1], spec.seq_k)
        lo_b = max(-(-max(lo_pos, 0) // g.bk), g.row_lo[i])
        hi_b = min(hi_pos // g.bk, g.row_hi[i])
        lo_out.append(lo_b)
        hi_out.append(max(hi_b, lo_b))
    return tuple(lo_out), tuple(hi_out)


def with_full_ranges(g: Geometry, tables: Tables, *, has_mask: bool) -> Tables:
    """``tables`` plus the full-tile ranges (empty everywhere when a ``mask`` array, or a
    ``mask_mod`` without a block mask, is given)."""
    lo, hi = full_block_ranges(g)
    if has_mask or (g.has_mask_mod and not g.mask_mod_classified):
        hi = lo
    return tables._replace(
        full_lo=jnp.asarray(np.asarray(lo, np.int32)), full_hi=jnp.asarray(np.asarray(hi, np.int32))
    )


def with_step_codes(g: Geometry, tables: Tables, *, by_rows: bool, has_mask: bool) -> Tables:
    """``tables`` plus the per-step codes (``Tables.step_code``) of a call without segment ids
    (unchanged with them: their ranges depend on the ids).

    For resident block ``r`` (query block ``by_rows``, else key block) and step ``s``: the streamed
    block :class:`~flashport.kernels.backends.pallas_tpu.tiling.Step` visits (the range's last block once the
    range is done, so no DMA is repeated) and whether the tile is skipped, partial or fully visible
    (the ranges of :func:`with_full_ranges`). Unchanged too when a mask_mod's tile classes decide
    which tiles run and which are full (:attr:`Tables.mod_classes`, read per step by ``Step``).
    """
    if tables.segmented or g.mask_mod_classified:
        return tables
    lo, hi = (g.row_lo, g.row_hi) if by_rows else (g.col_lo, g.col_hi)
    n_rows, n_cols = (g.nq, g.nk) if by_rows else (g.nk, g.nq)
    steps = g.steps_k if by_rows else g.steps_q
    full = np.zeros((g.nq, g.nk), bool)
    if not (has_mask or g.has_mask_mod):
        for i, (a, b) in enumerate(zip(*full_block_ranges(g), strict=True)):
            full[i, a:b] = True
    if not by_rows:
        full = full.T
    code = np.zeros((n_rows, steps), np.int64)
    for r in range(n_rows):
        count = hi[r] - lo[r]
        for s in range(steps):
            block = min(lo[r] + min(s, max(count - 1, 0)), n_cols - 1)
            cls = STEP_SKIP if s >= count else (STEP_FULL if full[r, block] else STEP_PARTIAL)
            code[r, s] = block << STEP_CODE_BITS | cls
    return tables._replace(step_code=jnp.asarray(code.reshape(-1).astype(np.int32)))


def bodies(g: Geometry, *, has_mask: bool, segmented: bool) -> tuple[bool, bool]:
    """``(full_body, partial_body)``: which tile bodies a kernel must build.

    The mask-free body only when some tile can be fully visible; the masked body when some tile can
    be partial (always with a mask or segment ids), or when no tile is full at all.
    """
    lo, hi = full_block_ranges(g)
    full = not has_mask and not (g.has_mask_mod and not g.mask_mod_classified)
    full = full and any(h > l for l, h in zip(lo, hi, strict=True))
    partial = has_mask or segmented or g.has_mask_mod or not full
    partial = partial or any(
        (h - l) != (rh - rl) for l, h, rl, rh in zip(lo, hi, g.row_lo, g.row_hi, strict=True)
    )
    return full, partial


def when_by_class(run, is_full, body, *, full_body: bool, partial_body: bool) -> None:
    """Run ``body(masked)`` under ``pl.when``: the mask-free body on full tiles, the masked one on the rest.

    Each body is traced inside its named scope (:data:`FULL_SCOPE` / :data:`PARTIAL_SCOPE`).

    ``run`` is the step's scalar "compute this tile" condition, ``is_full()`` builds the scalar
    :func:`tile_is_full` (only called when both bodies exist).
    """

    def scoped(masked):
        def run_body():
            with jax.named_scope(PARTIAL_SCOPE if masked else FULL_SCOPE):
                body(masked)

        return run_body

    if full_body and partial_body:
        full = is_full()
        pl.when(jnp.logical_and(run, full))(scoped(False))
        pl.when(jnp.logical_and(run, jnp.logical_not(full)))(scoped(True))
    else:
        pl.when(run)(scoped(not full_body))


def tile_is_full(tables: Tables, b, q_block, k_block, nq: int, nk: int):
    """In-kernel scalar bool: tile (``q_block``, ``k_block``) of batch row ``b`` is fully visible.

    Reads the static full range of the query block and, with segment ids, requires the query and key
    blocks to hold one single, equal segment id; with a ``mask_mod``, the tile's class in its block
    mask must be FULL.
    """
    full = jnp.logical_and(tables.full_lo[q_block] <= k_block, k_block < tables.full_hi[q_block])
    if tables.segmented:
        t = tables
        qi, kj = b * nq + q_block, b * nk + k_block
        same = jnp.logical_and(t.q_min[qi] == t.q_max[qi], t.k_min[kj] == t.k_max[kj])
        full = jnp.logical_and(full, jnp.logical_and(same, t.q_min[qi] == t.k_min[kj]))
    if tables.mod_classes is not None:
        full = jnp.logical_and(full, mod_class(tables, b, q_block, k_block, nq, nk) == block_mask_lib.FULL)
    return full
