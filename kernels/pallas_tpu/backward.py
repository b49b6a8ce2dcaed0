"""Backward Pallas TPU flash-attention kernels: dK/dV (key-major) and dQ (query-major, + dbias).

Both recompute probabilities ``P = exp(S - lse)`` from the forward's saved log-sum-exp and use
``di = rowsum(dO * O)`` (computed in XLA), with the same masking and block skipping as the forward.
With dropout both regenerate the forward's keep-mask Z from the head-seed table (never stored):
``dV = (P∘Z/(1-p))ᵀ dO``, ``dP = (dO Vᵀ)∘Z/(1-p)``, ``dS = P∘(dP - di)``.


* dK/dV: grid ``(B, Hkv, nk, G, steps_q)``. K/V blocks stay resident while the query blocks that can
  see them (and, for GQA, all G query heads of the group) stream past; dK/dV accumulate in f32 VMEM
  scratch and are written once, so K/V grads are never materialized per query head.
* dQ: grid ``(B, Hq, nq, steps_k)`` like the forward; dQ accumulates in f32 scratch. When a bias is
  given it also writes ``dS`` tiles (the bias gradient), row/column-summed in-kernel over broadcast
  sequence dims, into an output aliased to zeros so that skipped tiles read as 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels import dropout
from flashport.kernels.pallas_tpu.blocks import LANES
from flashport.kernels.pallas_tpu.classify import DROPOUT_SCOPE, bodies, tile_is_full, when_by_class
from flashport.kernels.pallas_tpu.specs import key_major_specs, query_major_specs
from flashport.kernels.pallas_tpu.tiling import Geometry, Step, load, scores, tile_keep, tile_visible
from flashport.kernels.spec import softcap_grad

_SQ = pl.Squeezed()
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _dot(a, b, dims):
    """f32-accumulated matmul in ``b``'s dtype (the operand loaded from HBM: bf16 or f32)."""
    return jax.lax.dot_general(a.astype(b.dtype), b, dims, preferred_element_type=jnp.float32)


def _probs_and_dlogits(g, st_q, st_k, q, k, v, do, lse, di, bias, mask, qs, ks, head_seed, masked=True):
    """Recompute one tile: returns ``(p_dropped, dlogits, raw)`` (all f32 [bq, bk]).

    ``masked=False`` (a fully visible tile) builds no mask at all.

    ``dlogits = P * (dP - di)`` with ``dP = (dO·Vᵀ)∘Z/(1-rate)`` is the gradient w.r.t. the biased,
    soft-capped scores (and so the bias gradient); ``p_dropped = P∘Z/(1-rate)`` is what multiplied V
    in the forward (``P`` itself without dropout); ``raw`` are the pre-softcap scaled scores. The
    keep-mask Z is regenerated from ``head_seed`` and the tile's positions.
    """
    s, raw = scores(g, q, k, bias)
    vis = tile_visible(g, st_q, st_k, mask, qs, ks) if masked else None
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    # lse and di arrive as compact [1, bq] rows; the tile needs [bq, 1] columns.
    lse0, di = lse.T, di.T
    p = jnp.exp(s - jnp.where(lse0 == -jnp.inf, 0.0, lse0))
    dp = _dot(do, v, _NT)
    p_dropped = p
    if g.spec.dropout_rate:
        with jax.named_scope(DROPOUT_SCOPE):
            keep = tile_keep(g, head_seed, st_q, st_k)
            rate = g.spec.dropout_rate
            p_dropped, dp = dropout.apply(p, keep, rate), dropout.apply(dp, keep, rate)
    dlogits = p * (dp - di)
    return p_dropped, dlogits, raw


def _dscores(g: Geometry, dlogits, raw):
    """Gradient w.r.t. the unscaled Q·Kᵀ: through the softcap's tanh and the scale."""
    grad = softcap_grad(g.spec, raw, jnp)
    if grad is not None:
        dlogits = dlogits * grad
    return dlogits * g.spec.scale


def _dkv_kernel(
    tables,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    di_ref,
    bias_ref,
    mask_ref,
    q_seg_ref,  # inputs
    kv_seg_ref,
    dk_ref,
    dv_ref,
    dk_scr,
    dv_scr,
    *,
    g: Geometry,
    group: int,
    classes: tuple[bool, bool],
):
    """One grid step ``(b, hk, j, gi, i)``: add query block ``Step(...).block`` of query head
    ``hk * G + gi`` to the resident key block j's dK/dV (absent inputs are ``None``)."""
    bi, hk, j, gi, i = (pl.program_id(a) for a in range(5))
    st = Step(tables, bi, j, i, g.nk, g.nq, by_rows=False)

    @pl.when(jnp.logical_and(gi == 0, i == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def _compute(masked):
        q, do = q_ref[...], do_ref[...]
        head_seed = None
        if g.spec.dropout_rate:
            head_seed = tables.head_seeds[bi * pl.num_programs(1) * group + hk * group + gi]
        p, dlogits, raw = _probs_and_dlogits(
            g,
            st.block,
            j,
            q,
            k_ref[...],
            v_ref[...],
            do,
            lse_ref[...],
            di_ref[...],
            load(bias_ref),
            load(mask_ref),
            load(q_seg_ref),
            load(kv_seg_ref),
            head_seed,
            masked,
        )
        dv_scr[...] += _dot(p, do, _TN)
        dk_scr[...] += _dot(_dscores(g, dlogits, raw), q, _TN)

    is_full = lambda: tile_is_full(tables, bi, st.block, j, g.nq, g.nk)  # noqa: E731
    when_by_class(st.run, is_full, _compute, full_body=classes[0], partial_body=classes[1])

    @pl.when(jnp.logical_and(gi == group - 1, i == g.steps_q - 1))
    def _finish():
        dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def dkv_call(g: Geometry, q, k, v, do, lse, di, bias, mask, q_seg, kv_seg, tables, *, interpret):
    """dK/dV kernel on padded operands; returns ``(dk [B, Hkv, Skp, Dp], dv [B, Hkv, Skp, Dvp])``.

    ``tables`` is the call's column-major :class:`~flashport.kernels.pallas_tpu.tiling.Tables`.
    """
    b, hq, _, dp = q.shape
    hkv, dvp = k.shape[1], v.shape[3]
    group = hq // hkv
    maps, in_specs = key_major_specs(g, q, k, v, bias, mask, q_seg is not None)
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [pl.BlockSpec((_SQ, _SQ, g.bk, dp), maps.kv), pl.BlockSpec((_SQ, _SQ, g.bk, dvp), maps.kv)]

    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * sum(h - l for l, h in zip(g.col_lo, g.col_hi, strict=False))
    cost = pl.CostEstimate(
        flops=int(tiles * g.bq * g.bk * (4 * dp + 4 * dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int(
            (k.size + v.size) * itemsize * 2 + tiles * g.bq * ((dp + dvp) * itemsize + 2 * LANES * 4)
        ),
    )
    return pl.pallas_call(
        functools.partial(
            _dkv_kernel,
            g=g,
            group=group,
            classes=bodies(g, has_mask=mask is not None, segmented=q_seg is not None),
        ),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, g.nk, group, g.steps_q),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((g.bk, dp), jnp.float32), pltpu.VMEM((g.bk, dvp), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="flashport_flash_dkv",
    )(tables, q, k, v, do, lse, di, bias, mask, q_seg, kv_seg)


def dbias_block(g: Geometry, bias_shape):
    """Rows/cols of the per-tile bias-gradient block: the tile size, or 1 on a broadcast dim."""
    return (g.bq if bias_shape[2] > 1 else 1), (g.bk if bias_shape[3] > 1 else 1)


# The same leading refs as _dkv_kernel, deliberately: Pallas passes refs positionally in the order
# of the in_specs, and both kernels read the same inputs (tables, q, k, v, dO, lse, delta, ...).
def _dq_kernel(
    tables,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    di_ref,
    bias_ref,
    mask_ref,
    q_seg_ref,  # inputs
    kv_seg_ref,
    dbias_zeros_ref,
    *rest,
    g: Geometry,
    dbias_block,
    classes: tuple[bool, bool],
):
    """One grid step ``(b, h, i, j)``: add key block ``Step(...).block`` to query block i's dQ.

    ``rest`` is ``dq_ref, [dbias_ref,] dq_scratch``. With a bias, ``dbias_zeros_ref`` (HBM, never
    read) is the zero-filled buffer the dbias output aliases, and ``dbias_block`` its ``(rq, rk)``.
    """
    del dbias_zeros_ref
    has_bias = dbias_block is not None
    dq_ref, dq_scr = rest[0], rest[-1]
    db_ref = rest[1] if has_bias else None
    bi, h, i, j = (pl.program_id(a) for a in range(4))
    st = Step(tables, bi, i, j, g.nq, g.nk, by_rows=True)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def _compute(masked):
        k = k_ref[...]
        head_seed = tables.head_seeds[bi * pl.num_programs(1) + h] if g.spec.dropout_rate else None
        _, dlogits, raw = _probs_and_dlogits(
            g,
            i,
            st.block,
            q_ref[...],
            k,
            v_ref[...],
            do_ref[...],
            lse_ref[...],
            di_ref[...],
            load(bias_ref),
            load(mask_ref),
            load(q_seg_ref),
            load(kv_seg_ref),
            head_seed,
            masked,
        )
        dq_scr[...] += _dot(_dscores(g, dlogits, raw), k, _NN)
        if has_bias:
            rq, rk = dbias_block
            tile = dlogits
            if rq == 1:
                tile = jnp.sum(tile, axis=0, keepdims=True)
            if rk == 1:
                tile = jnp.sum(tile, axis=1, keepdims=True)
            db_ref[...] = tile

    is_full = lambda: tile_is_full(tables, bi, i, st.block, g.nq, g.nk)  # noqa: E731
    when_by_class(st.run, is_full, _compute, full_body=classes[0], partial_body=classes[1])

    if has_bias:
        # A block entered without computing (empty row, or skipped by segment ids) must still be
        # written: output blocks are not read from HBM, so it would otherwise flush garbage.
        @pl.when(jnp.logical_and(jnp.logical_not(st.run), jnp.logical_or(j == 0, j < st.count)))
        def _zero():
            db_ref[...] = jnp.zeros(db_ref.shape, jnp.float32)

    @pl.when(j == g.steps_k - 1)
    def _finish():
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def dq_call(g: Geometry, q, k, v, do, lse, di, bias, mask, q_seg, kv_seg, tables, *, interpret):
    """dQ (+ bias gradient) kernel on padded operands.

    Returns ``(dq [B, Hq, Sqp, Dp], dbias_tiles)`` where ``dbias_tiles`` is ``None`` without a bias,
    else f32 [B, Hq, nq, nk, rq, rk] (see :func:`dbias_block`); the caller reduces it to the bias
    shape. ``tables`` is the call's row-major :class:`~flashport.kernels.pallas_tpu.tiling.Tables`.
    """
    b, hq, _, dp = q.shape
    dvp = v.shape[3]
    maps, in_specs = query_major_specs(g, q, k, v, bias, mask, q_seg is not None, grads=True)
    operands = [q, k, v, do, lse, di, bias, mask, q_seg, kv_seg]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((_SQ, _SQ, g.bq, dp), maps.q)]
    aliases, block, zeros = {}, None, None
    if bias is not None:
        block = rq, rk = dbias_block(g, bias.shape)
        dshape = (b, hq, g.nq, g.nk, rq, rk)
        # Tiles the grid never visits keep these zeros (their true gradient is 0).
        zeros = jnp.zeros(dshape, jnp.float32)
        aliases = {len(jax.tree_util.tree_leaves((tables, *operands))): 1}
        out_shape.append(jax.ShapeDtypeStruct(dshape, jnp.float32))
        out_specs.append(
            pl.BlockSpec(
                (_SQ, _SQ, _SQ, _SQ, rq, rk),
                lambda bi, h, i, j, t: (bi, h, i, maps.step(bi, h, i, j, t).block, 0, 0),
            )
        )
    in_specs.append(None if zeros is None else pl.BlockSpec(memory_space=pl.ANY))

    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * g.visited_tiles
    cost = pl.CostEstimate(
        flops=int(tiles * g.bq * g.bk * (4 * dp + 2 * dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int(
            (2 * q.size + do.size) * itemsize
            + 2 * b * hq * g.sqp * LANES * 4
            + tiles * g.bk * (dp + dvp) * itemsize
            + (tiles * block[0] * block[1] * 4 * 2 if block else 0)
        ),
    )
    return pl.pallas_call(
        functools.partial(
            _dq_kernel,
            g=g,
            dbias_block=block,
            classes=bodies(g, has_mask=mask is not None, segmented=q_seg is not None),
        ),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hq, g.nq, g.steps_k),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((g.bq, dp), jnp.float32)],
        ),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="flashport_flash_dq",
    )(tables, *operands, zeros)
