"""Forward Pallas TPU flash-attention kernel: online softmax over key/value blocks.

Grid ``(B, Hq, nq, steps_k)``; the key axis is last and ``"arbitrary"`` (it carries the running
max ``m``, sum ``l`` and f32 accumulator in VMEM scratch), the others ``"parallel"``. Step j of query
block i visits key block ``lo_i + j`` (see :mod:`flashport.kernels.pallas_tpu.tiling`); K/V index
maps use kv head ``h // (Hq // Hkv)`` so GQA/MQA never repeats K/V. Broadcast bias/mask dims are
indexed at 0 instead of being materialized. Outputs: ``out`` [B, Hq, Sqp, Dvp] and the log-sum-exp
as lane-replicated f32 tiles [B, Hq, Sqp, 128] (sliced to [B, Hq, Sq] by the caller).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels import dropout
from flashport.kernels.pallas_tpu.blocks import LANES
from flashport.kernels.pallas_tpu.specs import query_major_specs
from flashport.kernels.pallas_tpu.tiling import Geometry, Step, load, scores, tile_keep, tile_visible

_SQ = pl.Squeezed()


def _forward_kernel(
    tables,
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    mask_ref,
    q_seg_ref,
    kv_seg_ref,  # inputs
    o_ref,
    lse_ref,
    *rest,
    g: Geometry,
    count_visits: bool,
):
    """One grid step ``(b, h, i, j)``: fold key block ``Step(...).block`` into query block i's softmax.

    ``rest`` is ``[visits_ref,] m_scratch, l_scratch, acc_scratch``; absent inputs are ``None``.
    """
    visits_ref = rest[0] if count_visits else None
    m_scr, l_scr, acc_scr = rest[-3:]
    bi, h, i, j = (pl.program_id(a) for a in range(4))
    st = Step(tables, bi, i, j, g.nq, g.nk, by_rows=True)
    rate = g.spec.dropout_rate

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        if count_visits:
            visits_ref[...] = jnp.zeros(visits_ref.shape, jnp.int32)

    @pl.when(st.run)
    def _compute():
        s, _ = scores(g, q_ref[...], k_ref[...], load(bias_ref))
        vis = tile_visible(g, i, st.block, load(mask_ref), load(q_seg_ref), load(kv_seg_ref))
        if vis is not None:
            s = jnp.where(vis, s, -jnp.inf)
        m_prev = m_scr[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe[:, :1])
        l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
        m_scr[...] = m_new
        # Dropout acts on the normalized probabilities: l (and so lse) sums the undropped p.
        keep = tile_keep(g, tables.head_seeds[bi * pl.num_programs(1) + h] if rate else None, i, st.block)
        if keep is not None:
            p = dropout.apply(p, keep, rate)
        vv = v_ref[...]
        pv = jax.lax.dot_general(
            p.astype(vv.dtype), vv, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        acc_scr[...] = acc_scr[...] * alpha[:, :1] + pv
        if count_visits:
            visits_ref[...] = visits_ref[...] + 1

    @pl.when(j == g.steps_k - 1)
    def _finish():
        l = l_scr[...]
        m = m_scr[...]
        seen = l > 0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        o_ref[...] = (acc_scr[...] * inv[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def forward_call(g: Geometry, q, k, v, bias, mask, q_seg, kv_seg, tables, *, interpret, count_visits=False):
    """Run the forward kernel on padded operands; returns ``(out, lse128[, visits])``.

    ``q`` [B, Hq, Sqp, Dp], ``k`` [B, Hkv, Skp, Dp], ``v`` [B, Hkv, Skp, Dvp] (already padded),
    ``bias``/``mask``/segment ids prepared by :func:`prepare_operands` (or ``None``), ``tables`` the
    call's :class:`~flashport.kernels.pallas_tpu.tiling.Tables` (``head_seeds`` set for dropout).
    ``count_visits`` adds an int32 output counting computed tiles per (b, h, query block) - an
    instrumentation used by the block-skipping test.
    """
    b, hq, _, dp = q.shape
    dvp = v.shape[3]
    maps, in_specs = query_major_specs(g, q, k, v, bias, mask, q_seg is not None, grads=False)
    operands = [q, k, v, bias, mask, q_seg, kv_seg]

    out_shape = [
        jax.ShapeDtypeStruct((b, hq, g.sqp, dvp), q.dtype),
        jax.ShapeDtypeStruct((b, hq, g.sqp, LANES), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((_SQ, _SQ, g.bq, dvp), maps.q),
        pl.BlockSpec((_SQ, _SQ, g.bq, LANES), maps.q),
    ]
    if count_visits:
        out_shape.append(jax.ShapeDtypeStruct((b, hq, g.nq * 8, LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((_SQ, _SQ, 8, LANES), maps.q))

    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * g.visited_tiles
    extra = 0
    for x in (bias, mask):
        if x is not None:
            extra += (
                tiles * (g.bq if x.shape[2] > 1 else 1) * (g.bk if x.shape[3] > 1 else 1) * x.dtype.itemsize
            )
    cost = pl.CostEstimate(
        flops=int(tiles * 2 * g.bq * g.bk * (dp + dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int(
            q.size * itemsize
            + b * hq * g.sqp * (dvp * itemsize + LANES * 4)
            + tiles * g.bk * (dp + dvp) * itemsize
            + extra
        ),
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hq, g.nq, g.steps_k),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((g.bq, LANES), jnp.float32),
            pltpu.VMEM((g.bq, LANES), jnp.float32),
            pltpu.VMEM((g.bq, dvp), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_forward_kernel, g=g, count_visits=count_visits),
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="flashport_flash_fwd",
    )(tables, *operands)
