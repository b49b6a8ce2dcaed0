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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels.pallas_tpu.blocks import LANES
from flashport.kernels import dropout
from flashport.kernels.pallas_tpu.forward import QueryMajorMaps, bias_spec
from flashport.kernels.pallas_tpu.tiling import Geometry, Step, scores, tile_keep, tile_visible

_SQ = pl.Squeezed()
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _dot(a, b, dims):
    """f32-accumulated matmul in ``b``'s dtype (the operand loaded from HBM: bf16 or f32)."""
    return jax.lax.dot_general(a.astype(b.dtype), b, dims, preferred_element_type=jnp.float32)


def _probs_and_dlogits(g, st_q, st_k, q, k, v, do, lse, di, bias, mask, qs, ks, head_seed):
    """Recompute one tile: returns ``(p_dropped, dlogits, raw)`` (all f32 [bq, bk]).

    ``dlogits = P * (dP - di)`` with ``dP = (dO·Vᵀ)∘Z/(1-rate)`` is the gradient w.r.t. the biased,
    soft-capped scores (and so the bias gradient); ``p_dropped = P∘Z/(1-rate)`` is what multiplied V
    in the forward (``P`` itself without dropout); ``raw`` are the pre-softcap scaled scores. The
    keep-mask Z is regenerated from ``head_seed`` and the tile's positions.
    """
    s, raw = scores(g, q, k, bias)
    vis = tile_visible(g, st_q, st_k, mask, qs, ks)
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    lse0 = lse[:, :1]
    p = jnp.exp(s - jnp.where(lse0 == -jnp.inf, 0.0, lse0))
    dp = _dot(do, v, _NT)
    keep = tile_keep(g, head_seed, st_q, st_k)
    p_dropped = p
    if keep is not None:
        rate = g.spec.dropout_rate
        p_dropped, dp = dropout.apply(p, keep, rate), dropout.apply(dp, keep, rate)
    dlogits = p * (dp - di[:, :1])
    return p_dropped, dlogits, raw


def _dscores(g: Geometry, dlogits, raw):
    """Gradient w.r.t. the unscaled Q·Kᵀ: through the softcap's tanh and the scale."""
    if g.spec.softcap is not None:
        t = jnp.tanh(raw / g.spec.softcap)
        dlogits = dlogits * (1.0 - t * t)
    return dlogits * g.spec.scale


def _split_refs(refs, n_tables, has_bias, has_mask, segmented):
    tabs = refs[:n_tables]
    refs = list(refs[n_tables:])
    named = dict(zip(("q", "k", "v", "do", "lse", "di"), refs[:6]))
    pos = 6
    for name, present in (("bias", has_bias), ("mask", has_mask)):
        named[name] = refs[pos] if present else None
        pos += present
    named["qs"] = named["ks"] = None
    if segmented:
        named["qs"], named["ks"] = refs[pos], refs[pos + 1]
        pos += 2
    return tabs, named, refs[pos:]


def _load(ref):
    return None if ref is None else ref[...]


def dkv_call(g: Geometry, q, k, v, do, lse, di, bias, mask, q_seg, kv_seg, tables, *, interpret):
    """dK/dV kernel on padded operands; returns ``(dk [B, Hkv, Skp, Dp], dv [B, Hkv, Skp, Dvp])``."""
    b, hq, _, dp = q.shape
    hkv, dvp = k.shape[1], v.shape[3]
    group = hq // hkv
    segmented = q_seg is not None
    n_tables = len(tables)
    dropping = g.spec.dropout_rate > 0

    def step_of(bi, hk, j, gi, i, *tabs):
        return Step(tabs, bi, j, i, g.nk, g.nq, segmented, by_rows=False)

    def q_map(bi, hk, j, gi, i, *tabs):
        return bi, hk * group + gi, step_of(bi, hk, j, gi, i, *tabs).block, 0

    def kv_map(bi, hk, j, gi, i, *tabs):
        return bi, hk, j, 0

    def bias_index(bi, hk, j, gi, i, *tabs):
        return bi, hk * group + gi, step_of(bi, hk, j, gi, i, *tabs).block, j

    in_specs = [
        pl.BlockSpec((_SQ, _SQ, g.bq, dp), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bk, dp), kv_map),
        pl.BlockSpec((_SQ, _SQ, g.bk, dvp), kv_map),
        pl.BlockSpec((_SQ, _SQ, g.bq, dvp), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bq, LANES), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bq, LANES), q_map),
    ]
    operands = [q, k, v, do, lse, di]
    for x in (bias, mask):
        if x is not None:
            in_specs.append(bias_spec(g, x.shape, bias_index))
            operands.append(x)
    if segmented:
        in_specs.append(
            pl.BlockSpec((_SQ, g.bq, 1), lambda bi, hk, j, gi, i, *t: (bi, step_of(bi, hk, j, gi, i, *t).block, 0))
        )
        in_specs.append(pl.BlockSpec((_SQ, 1, g.bk), lambda bi, hk, j, gi, i, *t: (bi, 0, j)))
        operands += [q_seg, kv_seg]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [pl.BlockSpec((_SQ, _SQ, g.bk, dp), kv_map), pl.BlockSpec((_SQ, _SQ, g.bk, dvp), kv_map)]

    def kernel(*refs):
        tabs, r, rest = _split_refs(refs, n_tables, bias is not None, mask is not None, segmented)
        dk_ref, dv_ref, dk_scr, dv_scr = rest
        bi, hk, j, gi, i = (pl.program_id(a) for a in range(5))
        st = Step(tabs, bi, j, i, g.nk, g.nq, segmented, by_rows=False)

        @pl.when(jnp.logical_and(gi == 0, i == 0))
        def _init():
            dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
            dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

        @pl.when(st.run)
        def _compute():
            qq, do = r["q"][...], r["do"][...]
            head_seed = tabs[-1][bi * hq + hk * group + gi] if dropping else None
            p, dlogits, raw = _probs_and_dlogits(
                g, st.block, j, qq, r["k"][...], r["v"][...], do, r["lse"][...], r["di"][...],
                _load(r["bias"]), _load(r["mask"]), _load(r["qs"]), _load(r["ks"]), head_seed,
            )
            dv_scr[...] += _dot(p, do, _TN)
            dk_scr[...] += _dot(_dscores(g, dlogits, raw), qq, _TN)

        @pl.when(jnp.logical_and(gi == group - 1, i == g.steps_q - 1))
        def _finish():
            dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)

    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * sum(h - l for l, h in zip(g.col_lo, g.col_hi))
    cost = pl.CostEstimate(
        flops=int(tiles * g.bq * g.bk * (4 * dp + 4 * dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int(
            (k.size + v.size) * itemsize * 2 + tiles * g.bq * ((dp + dvp) * itemsize + 2 * LANES * 4)
        ),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=n_tables,
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
    )(*tables, *operands)


def dbias_block(g: Geometry, bias_shape):
    """Rows/cols of the per-tile bias-gradient block: the tile size, or 1 on a broadcast dim."""
    return (g.bq if bias_shape[2] > 1 else 1), (g.bk if bias_shape[3] > 1 else 1)


def dq_call(g: Geometry, q, k, v, do, lse, di, bias, mask, q_seg, kv_seg, tables, *, interpret):
    """dQ (+ bias gradient) kernel on padded operands.

    Returns ``(dq [B, Hq, Sqp, Dp], dbias_tiles)`` where ``dbias_tiles`` is ``None`` without a bias,
    else f32 [B, Hq, nq, nk, rq, rk] (see :func:`dbias_block`); the caller reduces it to the bias
    shape.
    """
    b, hq, _, dp = q.shape
    hkv, dvp = k.shape[1], v.shape[3]
    group = hq // hkv
    segmented = q_seg is not None
    n_tables = len(tables)
    dropping = g.spec.dropout_rate > 0

    maps = QueryMajorMaps(g, group, segmented)
    q_map, kv_map, bias_index = maps.q, maps.kv, maps.bias

    in_specs = [
        pl.BlockSpec((_SQ, _SQ, g.bq, dp), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bk, dp), kv_map),
        pl.BlockSpec((_SQ, _SQ, g.bk, dvp), kv_map),
        pl.BlockSpec((_SQ, _SQ, g.bq, dvp), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bq, LANES), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bq, LANES), q_map),
    ]
    operands = [q, k, v, do, lse, di]
    for x in (bias, mask):
        if x is not None:
            in_specs.append(bias_spec(g, x.shape, bias_index))
            operands.append(x)
    if segmented:
        in_specs += maps.segment_specs()
        operands += [q_seg, kv_seg]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((_SQ, _SQ, g.bq, dp), q_map)]
    aliases = {}
    has_bias = bias is not None
    if has_bias:
        rq, rk = dbias_block(g, bias.shape)
        dshape = (b, hq, g.nq, g.nk, rq, rk)
        # Tiles the grid never visits keep these zeros (their true gradient is 0).
        aliases = {n_tables + len(operands): 1}
        operands.append(jnp.zeros(dshape, jnp.float32))
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_shape.append(jax.ShapeDtypeStruct(dshape, jnp.float32))
        out_specs.append(
            pl.BlockSpec((_SQ, _SQ, _SQ, _SQ, rq, rk),
                         lambda bi, h, i, j, *t: (bi, h, i, maps.step(bi, h, i, j, *t).block, 0, 0))
        )

    def kernel(*refs):
        tabs, r, rest = _split_refs(refs, n_tables, has_bias, mask is not None, segmented)
        if has_bias:
            _zeros_hbm, dq_ref, db_ref, dq_scr = rest
        else:
            dq_ref, dq_scr = rest
        bi, h, i, j = (pl.program_id(a) for a in range(4))
        st = Step(tabs, bi, i, j, g.nq, g.nk, segmented, by_rows=True)

        @pl.when(j == 0)
        def _init():
            dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

        @pl.when(st.run)
        def _compute():
            kk = r["k"][...]
            _, dlogits, raw = _probs_and_dlogits(
                g, i, st.block, r["q"][...], kk, r["v"][...], r["do"][...], r["lse"][...], r["di"][...],
                _load(r["bias"]), _load(r["mask"]), _load(r["qs"]), _load(r["ks"]),
                tabs[-1][bi * hq + h] if dropping else None,
            )
            dq_scr[...] += _dot(_dscores(g, dlogits, raw), kk, _NN)
            if has_bias:
                tile = dlogits
                if rq == 1:
                    tile = jnp.sum(tile, axis=0, keepdims=True)
                if rk == 1:
                    tile = jnp.sum(tile, axis=1, keepdims=True)
                db_ref[...] = tile

        if has_bias:
            # A block entered without computing (empty row, or skipped by segment ids) must still be
            # written: output blocks are not read from HBM, so it would otherwise flush garbage.
            @pl.when(jnp.logical_and(jnp.logical_not(st.run), jnp.logical_or(j == 0, j < st.count)))
            def _zero():
                db_ref[...] = jnp.zeros(db_ref.shape, jnp.float32)

        @pl.when(j == g.steps_k - 1)
        def _finish():
            dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)

    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * g.visited_tiles
    cost = pl.CostEstimate(
        flops=int(tiles * g.bq * g.bk * (4 * dp + 2 * dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int(
            (2 * q.size + do.size) * itemsize + 2 * b * hq * g.sqp * LANES * 4
            + tiles * g.bk * (dp + dvp) * itemsize
            + (tiles * rq * rk * 4 * 2 if has_bias else 0)
        ),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=n_tables,
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
    )(*tables, *operands)
