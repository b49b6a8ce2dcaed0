"""Forward Pallas TPU flash-attention kernel: online softmax over key/value blocks.

Grid ``(B, Hq, nq, steps_k)``; the key axis is last and ``"arbitrary"`` (it carries the running
max ``m``, sum ``l`` and f32 accumulator in VMEM scratch), the others ``"parallel"``. Step j of query
block i visits key block ``lo_i + j`` (see :mod:`flashport.kernels.pallas_tpu.tiling`); K/V index
maps use kv head ``h // (Hq // Hkv)`` so GQA/MQA never repeats K/V. Broadcast bias/mask dims are
indexed at 0 instead of being materialized. Outputs: ``out`` [B, Hq, Sqp, Dvp] and the log-sum-exp
as lane-replicated f32 tiles [B, Hq, Sqp, 128] (sliced to [B, Hq, Sq] by the caller).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels.pallas_tpu.blocks import LANES
from flashport.kernels import dropout
from flashport.kernels.pallas_tpu.tiling import Geometry, Step, scores, tile_keep, tile_visible

_SQ = pl.Squeezed()


def bias_spec(g: Geometry, shape, index_of):
    """BlockSpec of a rank-4 bias/mask with size-1 (broadcast) dims kept at block index 0.

    ``index_of(grid_indices, tables) -> (b, h, q_block, k_block)`` gives the indices to use for the
    non-broadcast dims.
    """
    bb, hb, sqb, skb = shape
    block = (_SQ, _SQ, g.bq if sqb > 1 else 1, g.bk if skb > 1 else 1)

    def index_map(*args):
        b, h, qi, kj = index_of(*args)
        return (b if bb > 1 else 0, h if hb > 1 else 0, qi if sqb > 1 else 0, kj if skb > 1 else 0)

    return pl.BlockSpec(block, index_map)


class QueryMajorMaps:
    """Index maps of the query-major grid ``(B, Hq, nq, steps_k)`` shared by the forward and dQ kernels.

    Step j of query block i visits key block ``Step(...).block`` (skipped steps repeat a fetched block,
    so they cost no DMA); K/V use kv head ``h // group``.
    """

    def __init__(self, g: Geometry, group: int, segmented: bool):
        self.g, self.group, self.segmented = g, group, segmented

    def step(self, bi, h, i, j, *tabs):
        """The visit schedule entry of grid point (bi, h, i, j)."""
        return Step(tabs, bi, i, j, self.g.nq, self.g.nk, self.segmented, by_rows=True)

    def q(self, bi, h, i, j, *tabs):
        """Query-side blocks (q, out, lse, dO, dQ): query block i."""
        return bi, h, i, 0

    def kv(self, bi, h, i, j, *tabs):
        """K/V blocks: the scheduled key block of the shared kv head."""
        return bi, h // self.group, self.step(bi, h, i, j, *tabs).block, 0

    def bias(self, bi, h, i, j, *tabs):
        """(b, h, q block, k block) indices for bias/mask tiles (see :func:`bias_spec`)."""
        return bi, h, i, self.step(bi, h, i, j, *tabs).block

    def segment_specs(self):
        """BlockSpecs of q/kv segment ids ([B, Sqp, 1] and [B, 1, Skp])."""
        g = self.g
        return [
            pl.BlockSpec((_SQ, g.bq, 1), lambda bi, h, i, j, *t: (bi, i, 0)),
            pl.BlockSpec((_SQ, 1, g.bk), lambda bi, h, i, j, *t: (bi, 0, self.step(bi, h, i, j, *t).block)),
        ]


def forward_call(g: Geometry, q, k, v, bias, mask, q_seg, kv_seg, tables, *, interpret, count_visits=False,
                 generation=None):
    """Run the forward kernel on padded operands; returns ``(out, lse128[, visits])``.

    ``q`` [B, Hq, Sqp, Dp], ``k`` [B, Hkv, Skp, Dp], ``v`` [B, Hkv, Skp, Dvp] (already padded),
    ``bias``/``mask`` prepared by :func:`prepare_operands`, ``tables`` from ``block_tables`` (with
    dropout, followed by the flattened uint32 [B * Hq] head-seed table of ``head_seed_table``).
    ``count_visits`` adds an int32 output counting computed tiles per (b, h, query block) - an
    instrumentation used by the block-skipping test.
    """
    b, hq, _, dp = q.shape
    hkv, dvp = k.shape[1], v.shape[3]
    group = hq // hkv
    segmented = q_seg is not None
    n_tables = len(tables)
    rate = g.spec.dropout_rate

    maps = QueryMajorMaps(g, group, segmented)
    q_map, kv_map, bias_index = maps.q, maps.kv, maps.bias

    in_specs = [
        pl.BlockSpec((_SQ, _SQ, g.bq, dp), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bk, dp), kv_map),
        pl.BlockSpec((_SQ, _SQ, g.bk, dvp), kv_map),
    ]
    operands = [q, k, v]
    if bias is not None:
        in_specs.append(bias_spec(g, bias.shape, bias_index))
        operands.append(bias)
    if mask is not None:
        in_specs.append(bias_spec(g, mask.shape, bias_index))
        operands.append(mask)
    if segmented:
        in_specs += maps.segment_specs()
        operands += [q_seg, kv_seg]

    out_shape = [
        jax.ShapeDtypeStruct((b, hq, g.sqp, dvp), q.dtype),
        jax.ShapeDtypeStruct((b, hq, g.sqp, LANES), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((_SQ, _SQ, g.bq, dvp), q_map),
        pl.BlockSpec((_SQ, _SQ, g.bq, LANES), q_map),
    ]
    if count_visits:
        out_shape.append(jax.ShapeDtypeStruct((b, hq, g.nq * 8, LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((_SQ, _SQ, 8, LANES), q_map))

    has_bias, has_mask = bias is not None, mask is not None

    def kernel(*refs):
        tabs = refs[:n_tables]
        refs = list(refs[n_tables:])
        q_ref, k_ref, v_ref = refs[:3]
        pos = 3
        bias_ref = mask_ref = qs_ref = ks_ref = None
        if has_bias:
            bias_ref, pos = refs[pos], pos + 1
        if has_mask:
            mask_ref, pos = refs[pos], pos + 1
        if segmented:
            qs_ref, ks_ref, pos = refs[pos], refs[pos + 1], pos + 2
        o_ref, lse_ref = refs[pos], refs[pos + 1]
        pos += 2
        cnt_ref = None
        if count_visits:
            cnt_ref, pos = refs[pos], pos + 1
        m_scr, l_scr, acc_scr = refs[pos:pos + 3]

        bi, h, i, j = (pl.program_id(a) for a in range(4))
        st = Step(tabs, bi, i, j, g.nq, g.nk, segmented, by_rows=True)

        @pl.when(j == 0)
        def _init():
            m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
            l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
            acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
            if count_visits:
                cnt_ref[...] = jnp.zeros(cnt_ref.shape, jnp.int32)

        @pl.when(st.run)
        def _compute():
            s, _ = scores(g, q_ref[...], k_ref[...], None if bias_ref is None else bias_ref[...])
            vis = tile_visible(
                g, i, st.block,
                None if mask_ref is None else mask_ref[...],
                None if qs_ref is None else qs_ref[...],
                None if ks_ref is None else ks_ref[...],
            )
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
            vv = v_ref[...]
            # Dropout acts on the normalized probabilities: l (and so lse) sums the undropped p.
            keep = tile_keep(g, tabs[-1][bi * hq + h] if rate else None, i, st.block)
            if keep is not None:
                p = dropout.apply(p, keep, rate)
            pv = jax.lax.dot_general(p.astype(vv.dtype), vv, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
            acc_scr[...] = acc_scr[...] * alpha[:, :1] + pv
            if count_visits:
                cnt_ref[...] = cnt_ref[...] + 1

        @pl.when(j == g.steps_k - 1)
        def _finish():
            l = l_scr[...]
            m = m_scr[...]
            seen = l > 0
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            o_ref[...] = (acc_scr[...] * inv[:, :1]).astype(o_ref.dtype)
            lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)

    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * g.visited_tiles
    extra = 0
    for x in (bias, mask):
        if x is not None:
            extra += tiles * (g.bq if x.shape[2] > 1 else 1) * (g.bk if x.shape[3] > 1 else 1) * x.dtype.itemsize
    cost = pl.CostEstimate(
        flops=int(tiles * 2 * g.bq * g.bk * (dp + dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int(
            q.size * itemsize + b * hq * g.sqp * (dvp * itemsize + LANES * 4)
            + tiles * g.bk * (dp + dvp) * itemsize + extra
        ),
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_tables,
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
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="flashport_flash_fwd",
    )(*tables, *operands)

