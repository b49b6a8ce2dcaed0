"""Forward Pallas TPU flash-attention kernel: online softmax over key/value blocks.

Two operand layouts, one kernel body (:class:`~flashport.kernels.backends.pallas_tpu.specs.Operands`):

* heads-major (BHSD): grid ``(B, Hkv / hb, nq, steps_k)``; one step serves the G query heads of
  each of ``hb`` kv heads (``Geometry.head_block``: as many as VMEM holds; their query rows form one
  ``[hb * G, bq, D]`` block, K/V ``[hb, bk, D]``), so every K/V block is fetched once per group
  rather than once per query head, and a step's fixed cost is paid once per hb kv heads;
* token-major (BSHD, the contract's default layout): grid ``(B, 1, nq, steps_k)``; one step serves
  every head: blocks ``[bq, Hq, D]`` of Q and ``[bk, Hkv, D]`` of K/V are read straight from the
  caller's BSHD arrays (no transpose in XLA before or after the kernel), each K/V block is fetched
  once for all heads. Mosaic cannot index the packed head dim of a 16-bit block dynamically, so the
  blocks are first copied heads-major into VMEM scratch (a short static loop of loads and stores,
  :meth:`~flashport.kernels.backends.pallas_tpu.specs.Operands.stage`: Q when the query block is entered,
  K/V on every computed step) and the tile body runs in a ``fori_loop`` over the heads on the copies,
  so Mosaic compiles one tile body, as heads-major.

The key axis is last and ``"arbitrary"`` (it carries the running max ``m``, sum ``l`` and f32
accumulator of each head in VMEM scratch), the others ``"parallel"``. Step j of query block i visits
key block ``lo_i + j`` (see :mod:`flashport.kernels.backends.pallas_tpu.tiling`). Each visited tile is
classified (:mod:`flashport.kernels.backends.pallas_tpu.classify`): fully visible tiles run a body without
any mask computation, partial tiles the masked body. Broadcast bias/mask dims are indexed at 0
instead of being materialized. Outputs: ``out`` in the operands' layout and, unless the caller needs
neither gradient nor lse, the log-sum-exp stored compactly as f32 rows ``[B, Hq, nq, 1, bq]`` (4 bytes
per query row; reshaped to [B, Hq, Sq] by the caller).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels.backends.pallas_tpu.blocks import LANES
from flashport.kernels.backends.pallas_tpu.classify import (
    DROPOUT_SCOPE,
    SOFTMAX_SCOPE,
    bodies,
    tile_is_full,
    when_by_class,
)
from flashport.kernels.backends.pallas_tpu.specs import Operands, grouped_specs, lse_rows_spec
from flashport.kernels.backends.pallas_tpu.tiling import (
    LOG2_E,
    Geometry,
    Step,
    folds_scale,
    load,
    mod_site,
    scores,
    tile_keep,
    tile_visible,
)
from flashport.kernels.semantics import dropout

_SQ = pl.Squeezed()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape facts of one forward call the kernel body needs."""

    group: int  # query heads per grid step: head_block * G (heads-major) or Hq (token-major)
    ops: Operands  # the operands' layout and how a head's rows are read from a block
    fold_scale: bool  # scores stay unscaled; the scale is folded into exp2 (tiling.folds_scale)
    bias_heads: bool  # the bias has a per-head dim (indexed by gi) rather than a broadcast one
    mask_heads: bool
    full_body: bool  # some tile may be fully visible: build the mask-free body
    partial_body: bool  # some tile may be partial: build the masked body
    count_tiles: bool  # instrumentation: count computed tiles per class
    write_lse: bool  # False: inference without lse, nothing is written


def _head_tile(g: Geometry, lay: Layout, refs, tables, bi, i, block, gi, masked: bool):
    """Fold key block ``block`` into query head ``hk * G + gi``'s running softmax."""
    q_ref, k_ref, v_ref, bias_ref, mask_ref, q_seg_ref, kv_seg_ref, m_scr, l_scr, acc_scr, hk = refs
    bias = None if bias_ref is None else (bias_ref[gi] if lay.bias_heads else bias_ref[...])
    at = mod_site(tables, bi, hk * lay.group + gi, i, block)
    q, k = lay.ops.q_rows(q_ref, gi), lay.ops.kv_rows(k_ref, gi)
    if lay.fold_scale:  # m and s in unscaled units; exp(scale * x) = exp2(c * x)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        c = g.spec.scale * LOG2_E
        exp = lambda x: jnp.exp2(x * c)  # noqa: E731
    else:
        s, _ = scores(g, q, k, bias, at)
        exp = jnp.exp
    if masked:
        mask = None if mask_ref is None else (mask_ref[gi] if lay.mask_heads else mask_ref[...])
        vis = tile_visible(g, i, block, mask, load(q_seg_ref), load(kv_seg_ref), at)
        if vis is not None:
            s = jnp.where(vis, s, -jnp.inf)
    with jax.named_scope(SOFTMAX_SCOPE):
        m_prev = m_scr[gi]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not NaN. A
        # mask-free tile gives every row a finite maximum.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = exp(m_prev - m_safe)
        p = exp(s - lanes(m_safe, s.shape[1]))
        l_scr[gi] = alpha * l_scr[gi] + jnp.sum(p, axis=1, keepdims=True)
        m_scr[gi] = m_new
    # Dropout acts on the normalized probabilities: l (and so lse) sums the undropped p.
    rate = g.spec.dropout_rate
    if rate:
        with jax.named_scope(DROPOUT_SCOPE):
            seed = tables.head_seeds[(bi * pl.num_programs(1) + hk) * lay.group + gi]
            p = dropout.apply(p, tile_keep(g, seed, i, block), rate)
    vv = lay.ops.kv_rows(v_ref, gi)
    with jax.named_scope(SOFTMAX_SCOPE):
        pv = jax.lax.dot_general(
            p.astype(vv.dtype), vv, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        acc_scr[gi] = acc_scr[gi] * lanes(alpha, pv.shape[1]) + pv


def lanes(stat, width: int):
    """A lane-replicated ``[rows, 128]`` statistic widened to ``[rows, width]``.

    Tiling whole 128-lane vregs copies registers; slicing one lane (``stat[:, :1]``) and broadcasting
    it costs a cross-lane permute per vreg, which sat on the tile's critical path.
    """
    if width % LANES == 0 and stat.shape[1] == LANES:
        return jnp.tile(stat, (1, width // LANES))
    return stat[:, :1]


def for_each_head(group: int, fn):
    """``fn(gi)`` for every head of the step: a ``fori_loop`` (one compiled tile body) when G > 1."""
    if group == 1:
        fn(0)
        return

    def body(gi, carry):
        fn(gi)
        return carry

    # int32 bounds: Python ints would make the head index int64 under jax_enable_x64 (Mosaic has none).
    jax.lax.fori_loop(jnp.int32(0), jnp.int32(group), body, 0)


def _forward_kernel(
    tables, q_ref, k_ref, v_ref, bias_ref, mask_ref, q_seg_ref, kv_seg_ref, o_ref, *rest, g, lay
):
    """One grid step ``(b, hk, i, j)``: fold key block ``Step(...).block`` into query block i of the
    step's heads. ``rest`` is ``[lse_ref,] [full_count_ref, partial_count_ref,] m, l, acc`` scratch
    and, token-major, the heads-major copies of the Q, K, V blocks (:meth:`Operands.stage`)."""
    lse_ref, rest = (rest[0], rest[1:]) if lay.write_lse else (None, rest)
    bi, hk, i, j = (pl.program_id(a) for a in range(4))
    st = Step(tables, bi, i, j, g.nq, g.nk, by_rows=True)
    if lay.ops.token_major:
        rest, (q_ref, k_ref, v_ref) = (
            rest[:-3],
            _staged(lay.ops, rest[-3:], (q_ref, k_ref, v_ref), j == 0, st.run),
        )
    m_scr, l_scr, acc_scr = rest[-3:]
    refs = (q_ref, k_ref, v_ref, bias_ref, mask_ref, q_seg_ref, kv_seg_ref, m_scr, l_scr, acc_scr, hk)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        for ref in rest[:-3]:
            ref[...] = jnp.zeros(ref.shape, jnp.int32)

    def body(masked: bool):
        for_each_head(
            lay.group,
            lambda gi: _head_tile(g, lay, refs, tables, bi, i, st.block, gi, masked),
        )
        if lay.count_tiles:
            count_ref = rest[1 if masked else 0]
            count_ref[...] = count_ref[...] + lay.group

    when_by_class(
        st.run,
        lambda: st.full if st.full is not None else tile_is_full(tables, bi, i, st.block, g.nq, g.nk),
        body,
        full_body=lay.full_body,
        partial_body=lay.partial_body,
    )

    @pl.when(j == g.steps_k - 1)
    def _finish():
        m_scale = g.spec.scale if lay.fold_scale else 1.0
        for_each_head(lay.group, lambda h: _normalize_head(acc_scr, m_scr, l_scr, lse_ref, h, m_scale))
        lay.ops.write_rows(o_ref, acc_scr)


def _normalize_head(acc_scr, m_scr, l_scr, lse_ref, h, m_scale):
    """Divide head ``h``'s accumulator by its sum in place (0 for rows that saw nothing) and write its
    lse row (``m_scale * m + log l``, ``-inf`` for rows that saw nothing) unless ``lse_ref`` is
    ``None``; ``m_scale`` turns a running max kept in unscaled units into scaled ones."""
    l, m = l_scr[h], m_scr[h]
    seen = l > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    acc_scr[h] = acc_scr[h] * lanes(inv, acc_scr.shape[-1])
    if lse_ref is not None:
        lse = jnp.where(seen, m * m_scale + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        # [bq, 128] lane-replicated -> one lane-dense [1, bq] row.
        lse_ref[h] = lse.T[:1, :]


def _staged(ops: Operands, scratch, blocks, resident, streamed):
    """Copy token-major Q (when ``resident``: the step that enters a query block) and K/V (when
    ``streamed``: every computed step) into their heads-major ``scratch``; returns the copies."""
    ops.stage_when(resident, [(blocks[0], scratch[0])])
    ops.stage_when(streamed, list(zip(blocks[1:], scratch[1:], strict=True)))
    return scratch


def forward_call(
    g: Geometry,
    q,
    k,
    v,
    bias,
    mask,
    q_seg,
    kv_seg,
    tables,
    *,
    interpret,
    ops: Operands,
    vmem_limit=None,
    write_lse=True,
    count_tiles=False,
    classify=True,
):
    """Run the forward kernel on padded operands; returns ``(out[, lse_rows][, full, partial])``.

    ``q``, ``k``, ``v`` are in ``ops``'s layout (heads-major [B, H, S, D] or token-major [B, S, H, D]),
    sequences padded to whole blocks, ``bias``/``mask``/segment ids prepared by
    :func:`prepare_operands` (or ``None``), ``tables`` the call's
    :class:`~flashport.kernels.backends.pallas_tpu.tiling.Tables` with the full-tile ranges (``head_seeds`` set
    for dropout). ``out`` has ``q``'s layout; the lse is f32 [B, Hq, nq, 1, bq] (``None`` unless
    ``write_lse``). ``count_tiles`` adds two int32 outputs [B, Hkv / head_block or 1, nq * 8, 128] counting the head
    tiles computed per grid row and query block through the mask-free and the masked body - the
    instrumentation of the counting harness and the block-skipping tests. ``classify=False`` runs the
    masked body on every tile (the previous kernel's behaviour; the counting harness's "before").
    """
    b, hq, hkv, dvp = ops.batch(q), ops.heads(q), ops.heads(k), v.shape[-1]
    step_heads = hq if ops.token_major else g.head_block * (hq // hkv)
    maps, in_specs = grouped_specs(g, ops, q, k, v, bias, mask, q_seg is not None)
    full_body, partial_body = bodies(g, has_mask=mask is not None, segmented=q_seg is not None)
    if not classify:
        full_body, partial_body = False, True
    lay = Layout(
        group=step_heads,
        ops=ops,
        fold_scale=folds_scale(g, bias is not None),
        bias_heads=bias is not None and bias.shape[1] > 1,
        mask_heads=mask is not None and mask.shape[1] > 1,
        full_body=full_body,
        partial_body=partial_body,
        count_tiles=count_tiles,
        write_lse=write_lse,
    )
    out_shape = [jax.ShapeDtypeStruct(ops.shape(b, hq, g.sqp, dvp), q.dtype)]
    out_specs = [ops.spec(step_heads, g.bq, dvp, maps.q)]
    if write_lse:
        out_shape.append(jax.ShapeDtypeStruct((b, hq, g.nq, 1, g.bq), jnp.float32))
        out_specs.append(lse_rows_spec(g, step_heads, maps.q))
    grid_kv = 1 if ops.token_major else hkv // g.head_block
    if count_tiles:
        for _ in range(2):
            out_shape.append(jax.ShapeDtypeStruct((b, grid_kv, g.nq * 8, LANES), jnp.int32))
            out_specs.append(pl.BlockSpec((_SQ, _SQ, 8, LANES), lambda bi, hk, i, j, t: (bi, hk, i, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, grid_kv, g.nq, g.steps_k),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((step_heads, g.bq, LANES), jnp.float32),
            pltpu.VMEM((step_heads, g.bq, LANES), jnp.float32),
            pltpu.VMEM((step_heads, g.bq, dvp), jnp.float32),
            *ops.stage_shapes(hq, g.bq, [(q.shape[-1], q.dtype)]),
            *ops.stage_shapes(hkv, g.bk, [(k.shape[-1], k.dtype), (dvp, v.dtype)]),
        ],
    )
    res = pl.pallas_call(
        functools.partial(_forward_kernel, g=g, lay=lay),
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit
        ),
        cost_estimate=_cost(g, ops, q, k, v, bias, mask, write_lse),
        interpret=interpret,
        name="flashport_flash_fwd",
    )(tables, q, k, v, bias, mask, q_seg, kv_seg)
    return tuple(res)


def _cost(g: Geometry, ops: Operands, q, k, v, bias, mask, write_lse: bool):
    """Analytic cost of the visited tiles: K/V are streamed once per kv head, not per query head."""
    b, hq, hkv, dp, dvp = ops.batch(q), ops.heads(q), ops.heads(k), q.shape[-1], v.shape[-1]
    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * g.visited_tiles
    extra = 0
    for x in (bias, mask):
        if x is not None:
            extra += (
                tiles * (g.bq if x.shape[2] > 1 else 1) * (g.bk if x.shape[3] > 1 else 1) * x.dtype.itemsize
            )
    return pl.CostEstimate(
        flops=int(tiles * 2 * g.bq * g.bk * (dp + dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int(
            q.size * itemsize
            + b * hq * g.sqp * (dvp * itemsize + (4 if write_lse else 0))
            + b * hkv * g.visited_tiles * g.bk * (dp + dvp) * itemsize
            + extra
        ),
    )
