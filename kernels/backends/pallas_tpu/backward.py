"""Backward Pallas TPU flash-attention kernels: dK/dV (key-major) and dQ (query-major, + dbias).

Both recompute probabilities ``P = exp(S - lse)`` from the forward's saved log-sum-exp and use
``di = rowsum(dO * O)`` (computed in XLA), with the same masking and block skipping as the forward.
With dropout both regenerate the forward's keep-mask Z from the head-seed table (never stored):
``dV = (P∘Z/(1-p))ᵀ dO``, ``dP = (dO Vᵀ)∘Z/(1-p)``, ``dS = P∘(dP - di)``.


* dK/dV: grid ``(B, Hkv, nk, G, steps_q)``, or ``(B, Hkv / hb, nk, 1, steps_q)`` with a head block
  (a step serves hb kv heads and all their query heads). K/V blocks stay resident while the query
  blocks that can see them (and, for GQA, all G query heads of the group) stream past; dK/dV accumulate in f32 VMEM
  scratch and are written once, so K/V grads are never materialized per query head. Its tiles are
  key-major, ``[bk, bq]`` (``K·Qᵀ``, ``V·dOᵀ``): the accumulated rows are keys, so ``P`` and ``dS``
  multiply dO and Q as they are (``P·dO``, ``dS·Q``) and the lse/di rows broadcast along the lanes
  without a transpose; a bias (or mask) tile, read ``[bq, bk]``, is transposed in the kernel.
* dQ: the forward's grouped grid ``(B, Hkv / hb, nq, steps_k)``: one step serves the G query heads of
  each of ``hb`` kv heads (``Geometry.head_block``), so each K/V block is fetched once per group (not
  once per query head) and a step's fixed cost is paid once per hb kv heads; dQ accumulates in
  f32 scratch. When a bias is given it also writes ``dS`` tiles (the bias gradient), row/column-summed
  in-kernel over broadcast sequence dims, into an output aliased to zeros so that skipped tiles read
  as 0.

Like the forward, both run on heads-major (BHSD) or token-major (the caller's BSHD) operands
(:class:`~flashport.kernels.backends.pallas_tpu.specs.Operands`); token-major steps serve every head (grid
extent 1 along the heads; the blocks are copied heads-major into VMEM scratch and the heads looped
over, as in the forward), so a BSHD gradient needs no transpose either. The lse
and ``di`` arrive as compact f32 rows ``[B, Hq, nq, 1, bq]``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashport.kernels.backends.pallas_tpu.classify import DROPOUT_SCOPE, bodies, tile_is_full, when_by_class
from flashport.kernels.backends.pallas_tpu.forward import for_each_head
from flashport.kernels.backends.pallas_tpu.specs import (
    Operands,
    grouped_specs,
    key_major_heads,
    key_major_specs,
)
from flashport.kernels.backends.pallas_tpu.tiling import (
    LOG2_E,
    Geometry,
    Step,
    folds_scale,
    load,
    mod_grad,
    mod_site,
    scores,
    tile_keep,
    tile_visible,
)
from flashport.kernels.contract.spec import softcap_grad
from flashport.kernels.semantics import dropout

_SQ = pl.Squeezed()
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims):
    """f32-accumulated matmul in ``b``'s dtype (the operand loaded from HBM: bf16 or f32)."""
    return jax.lax.dot_general(a.astype(b.dtype), b, dims, preferred_element_type=jnp.float32)


def _probs_and_dlogits(
    g, st_q, st_k, q, k, v, do, lse, di, bias, mask, qs, ks, head_seed, masked=True, at=None, key_major=False
):
    """Recompute one tile: returns ``(p_dropped, dlogits, raw)`` (all f32 [bq, bk], or all [bk, bq]
    with ``key_major``: then ``bias``, ``qs`` and ``ks`` come in that orientation too).

    ``masked=False`` (a fully visible tile) builds no mask at all. ``at``: the tile's
    :func:`~flashport.kernels.backends.pallas_tpu.tiling.mod_site` when the call has user mods; ``dlogits``
    is then pulled back through the score_mod.

    ``dlogits = P * (dP - di)`` with ``dP = (dO·Vᵀ)∘Z/(1-rate)`` is the gradient w.r.t. the biased,
    soft-capped scores (and so the bias gradient); ``p_dropped = P∘Z/(1-rate)`` is what multiplied V
    in the forward (``P`` itself without dropout); ``raw`` are the pre-softcap scaled scores. The
    keep-mask Z is regenerated from ``head_seed`` and the tile's positions.
    """
    fold = folds_scale(g, bias is not None)
    if fold:  # unscaled scores; exp(scale * raw - lse) = exp2(c * raw - lse * log2(e))
        a, b = (k, q) if key_major else (q, k)
        s = raw = jax.lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)
    else:
        s, raw = scores(g, q, k, bias, at, key_major)
    vis = tile_visible(g, st_q, st_k, mask, qs, ks, at, key_major) if masked else None
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    # lse and di arrive as compact [1, bq] rows: a key-major tile broadcasts them as they are, a
    # query-major one needs [bq, 1] columns (a transpose per tile).
    lse0 = jnp.where(lse == -jnp.inf, 0.0, lse)
    if fold:  # scaled while a row: a query-major tile would scale its [bq, 1] column lane-broadcast
        lse0 = lse0 * LOG2_E
    if not key_major:
        lse0, di = lse0.T, di.T
    if fold:
        p = jnp.exp2(s * (g.spec.scale * LOG2_E) - lse0)
    else:
        p = jnp.exp(s - lse0)
    dp = _dot(v, do, _NT) if key_major else _dot(do, v, _NT)
    p_dropped = p
    if g.spec.dropout_rate:
        with jax.named_scope(DROPOUT_SCOPE):
            keep = tile_keep(g, head_seed, st_q, st_k, key_major)
            rate = g.spec.dropout_rate
            p_dropped, dp = dropout.apply(p, keep, rate), dropout.apply(dp, keep, rate)
    dlogits = p * (dp - di)
    grad = mod_grad(g, raw, bias, at, key_major)
    if grad is not None:
        dlogits = jnp.where(p > 0, dlogits * grad, 0.0)
    return p_dropped, dlogits, raw


def _dscores(g: Geometry, dlogits, raw):
    """Gradient w.r.t. the scaled Q·Kᵀ (through the softcap's tanh). The constant ``scale`` is applied
    once to the accumulated dQ/dK (:func:`_scaled`), not to every score."""
    grad = softcap_grad(g.spec, raw, jnp)
    return dlogits if grad is None else dlogits * grad


def _scaled(g: Geometry, scratch):
    """Multiply an f32 dQ or dK accumulator by the attention scale in place (see :func:`_dscores`)."""
    scratch[...] = scratch[...] * g.spec.scale


@dataclasses.dataclass(frozen=True)
class GradLayout:
    """Static facts a backward kernel body needs: operand layout, heads per step, tile classes."""

    ops: Operands
    heads: int  # query heads per grid step: 1 (dK/dV heads-major) or hb * G (head block hb), or Hq
    spec_heads: int  # Hq: the row length of the dropout head-seed table
    bias_heads: bool  # the bias has a per-head dim (one tile per head of the step)
    mask_heads: bool
    classes: tuple[bool, bool]  # (full_body, partial_body)


def _head_seed(tables, g: Geometry, lay: GradLayout, bi, head):
    """The dropout seed ``t_bh`` of global query head ``head`` of batch row ``bi`` (``None``: no dropout)."""
    if not g.spec.dropout_rate:
        return None
    return tables.head_seeds[bi * lay.spec_heads + head]


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
    *staged,
    g: Geometry,
    lay: GradLayout,
):
    """One grid step ``(b, hk, j, gi, i)``: add query block ``Step(...).block`` of the step's query
    heads (head ``hk * G + gi``, or every head when token-major) to the resident key block j's dK/dV
    (absent inputs are ``None``). Token-major, ``staged`` are the heads-major VMEM copies of the
    K, V, Q, dO blocks (:meth:`Operands.stage`)."""
    bi, hk, j, gi, i = (pl.program_id(a) for a in range(5))
    st = Step(tables, bi, j, i, g.nk, g.nq, by_rows=False)
    ops, group = lay.ops, lay.ops.kv_group
    if ops.token_major:
        # K/V are resident (copied once per key block), Q/dO stream (copied on computed steps).
        ops.stage_when(jnp.logical_and(gi == 0, i == 0), [(k_ref, staged[0]), (v_ref, staged[1])])
        ops.stage_when(st.run, [(q_ref, staged[2]), (do_ref, staged[3])])
        k_ref, v_ref, q_ref, do_ref = staged

    @pl.when(jnp.logical_and(gi == 0, i == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    first = (hk * g.head_block * group + gi) if not ops.token_major else 0  # global query head of h = 0

    def head(h, masked):
        kv = h // group  # 0 when the step holds one query head
        q, do = ops.q_rows(q_ref, h), ops.q_rows(do_ref, h)
        p, dlogits, raw = _probs_and_dlogits(
            g,
            st.block,
            j,
            q,
            ops.kv_rows(k_ref, h),
            ops.kv_rows(v_ref, h),
            do,
            lse_ref[h],
            di_ref[h],
            _key_major(_tile(bias_ref, h, lay.bias_heads)),
            _tile(mask_ref, h, lay.mask_heads),
            load(q_seg_ref),
            load(kv_seg_ref),
            _head_seed(tables, g, lay, bi, first + h),
            masked,
            mod_site(tables, bi, first + h, st.block, j),
            key_major=True,
        )
        dv_scr[kv] += _dot(p, do, _NN)
        dk_scr[kv] += _dot(_dscores(g, dlogits, raw), q, _NN)

    def _compute(masked):  # one head, or a loop over the head block's / every head (token-major)
        for_each_head(lay.heads, lambda h: head(h, masked))

    is_full = lambda: st.full if st.full is not None else tile_is_full(tables, bi, st.block, j, g.nq, g.nk)  # noqa: E731
    when_by_class(st.run, is_full, _compute, full_body=lay.classes[0], partial_body=lay.classes[1])

    @pl.when(jnp.logical_and(gi == pl.num_programs(3) - 1, i == g.steps_q - 1))
    def _finish():
        _scaled(g, dk_scr)
        ops.write_rows(dk_ref, dk_scr)
        ops.write_rows(dv_ref, dv_scr)


def _key_major(bias_tile):
    """A [bq, bk]-oriented bias tile (or a broadcast [1, bk] / [bq, 1] one) as the key-major tile's
    [bk, bq] (f32: Mosaic transposes 32-bit tiles; the scores it is added to are f32 anyway)."""
    return None if bias_tile is None else bias_tile.astype(jnp.float32).T


def _tile(ref, h, per_head: bool):
    """The bias or mask tile of head ``h`` of the step (one shared tile when broadcast over heads)."""
    if ref is None:
        return None
    return ref[h] if per_head else ref[...]


def _grad_layout(g: Geometry, ops: Operands, heads: int, hq: int, bias, mask, segmented: bool) -> GradLayout:
    return GradLayout(
        ops=ops,
        heads=heads,
        spec_heads=hq,
        bias_heads=bias is not None and bias.shape[1] > 1,
        mask_heads=mask is not None and mask.shape[1] > 1,
        classes=bodies(g, has_mask=mask is not None, segmented=segmented),
    )


def dkv_call(
    g: Geometry,
    q,
    k,
    v,
    do,
    lse,
    di,
    bias,
    mask,
    q_seg,
    kv_seg,
    tables,
    *,
    interpret,
    ops: Operands,
    vmem_limit=None,
):
    """dK/dV kernel on padded operands in ``ops``'s layout; returns ``(dk, dv)`` in that layout.

    ``lse``/``di`` are f32 rows [B, Hq, nq, 1, bq]; ``tables`` is the call's column-major
    :class:`~flashport.kernels.backends.pallas_tpu.tiling.Tables`. The kernel computes key-major
    [bk, bq] tiles (K·Qᵀ, as the accumulated dK/dV rows are keys): ``P`` and ``dS`` then multiply dO
    and Q untransposed and the lse/di rows broadcast as they are. The segment ids (``q_seg``
    [B, Sqp, 1], ``kv_seg`` [B, 1, Skp]) are laid out for it here: queries along lanes, keys along rows.
    """
    b, hq, hkv = ops.batch(q), ops.heads(q), ops.heads(k)
    dp, dvp, group = q.shape[-1], v.shape[-1], hq // hkv
    if q_seg is not None:
        q_seg, kv_seg = jnp.swapaxes(q_seg, 1, 2), jnp.swapaxes(kv_seg, 1, 2)
    heads, kv_heads = key_major_heads(g, ops, hq, hkv)
    maps, in_specs = key_major_specs(g, ops, q, k, v, bias, mask, q_seg is not None)
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [
        ops.spec(kv_heads, g.bk, dp, maps.kv, squeeze=kv_heads == 1),
        ops.spec(kv_heads, g.bk, dvp, maps.kv, squeeze=kv_heads == 1),
    ]
    if ops.token_major:
        grid = (b, 1, g.nk, 1, g.steps_q)
    elif g.head_block > 1:
        grid = (b, hkv // g.head_block, g.nk, 1, g.steps_q)
    else:
        grid = (b, hkv, g.nk, group, g.steps_q)
    itemsize = jnp.dtype(q.dtype).itemsize
    tiles = b * hq * sum(h - l for l, h in zip(g.col_lo, g.col_hi, strict=False))
    cost = pl.CostEstimate(
        flops=int(tiles * g.bq * g.bk * (4 * dp + 4 * dvp)),
        transcendentals=int(tiles * g.bq * g.bk * (2 if g.spec.softcap is not None else 1)),
        bytes_accessed=int((k.size + v.size) * itemsize * 2 + tiles * g.bq * ((dp + dvp) * itemsize + 2 * 4)),
    )
    lay = _grad_layout(g, ops, heads, hq, bias, mask, q_seg is not None)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, g=g, lay=lay),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((kv_heads, g.bk, dp), jnp.float32),
                pltpu.VMEM((kv_heads, g.bk, dvp), jnp.float32),
                *ops.stage_shapes(hkv, g.bk, [(dp, k.dtype), (dvp, v.dtype)]),
                *ops.stage_shapes(hq, g.bq, [(dp, q.dtype), (dvp, do.dtype)]),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem_limit,
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
    lay: GradLayout,
    dbias_block,
):
    """One grid step ``(b, hk, i, j)``: add key block ``Step(...).block`` to query block i's dQ of the
    step's heads (the G heads of each kv head of head block hk, or every head when token-major).

    ``rest`` is ``dq_ref, [dbias_ref,] dq_scratch`` and, token-major, the heads-major VMEM copies of
    the Q, dO, K, V blocks (:meth:`Operands.stage`). With a bias, ``dbias_zeros_ref`` (HBM, never
    read) is the zero-filled buffer the dbias output aliases, and ``dbias_block`` its ``(rq, rk)``.
    """
    del dbias_zeros_ref
    has_bias = dbias_block is not None
    bi, hk, i, j = (pl.program_id(a) for a in range(4))
    st = Step(tables, bi, i, j, g.nq, g.nk, by_rows=True)
    ops = lay.ops
    if ops.token_major:
        # Q/dO are resident (copied when the query block is entered), K/V stream.
        rest, staged = rest[:-4], rest[-4:]
        ops.stage_when(j == 0, [(q_ref, staged[0]), (do_ref, staged[1])])
        ops.stage_when(st.run, [(k_ref, staged[2]), (v_ref, staged[3])])
        q_ref, do_ref, k_ref, v_ref = staged
    dq_ref, dq_scr = rest[0], rest[-1]
    db_ref = rest[1] if has_bias else None

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def head(gi, masked):
        k = ops.kv_rows(k_ref, gi)
        _, dlogits, raw = _probs_and_dlogits(
            g,
            i,
            st.block,
            ops.q_rows(q_ref, gi),
            k,
            ops.kv_rows(v_ref, gi),
            ops.q_rows(do_ref, gi),
            lse_ref[gi],
            di_ref[gi],
            _tile(bias_ref, gi, lay.bias_heads),
            _tile(mask_ref, gi, lay.mask_heads),
            load(q_seg_ref),
            load(kv_seg_ref),
            _head_seed(tables, g, lay, bi, hk * lay.heads + gi),
            masked,
            mod_site(tables, bi, hk * lay.heads + gi, i, st.block),
        )
        dq_scr[gi] += _dot(_dscores(g, dlogits, raw), k, _NN)
        if has_bias:
            rq, rk = dbias_block
            tile = dlogits
            if rq == 1:
                tile = jnp.sum(tile, axis=0, keepdims=True)
            if rk == 1:
                tile = jnp.sum(tile, axis=1, keepdims=True)
            db_ref[gi] = tile

    def _compute(masked):
        for_each_head(lay.heads, lambda gi: head(gi, masked))

    is_full = lambda: st.full if st.full is not None else tile_is_full(tables, bi, i, st.block, g.nq, g.nk)  # noqa: E731
    when_by_class(st.run, is_full, _compute, full_body=lay.classes[0], partial_body=lay.classes[1])

    if has_bias:
        # A block entered without computing (empty row, or skipped by segment ids) must still be
        # written: output blocks are not read from HBM, so it would otherwise flush garbage.
        @pl.when(jnp.logical_and(jnp.logical_not(st.run), jnp.logical_or(j == 0, j < st.count)))
        def _zero():
            db_ref[...] = jnp.zeros(db_ref.shape, jnp.float32)

    @pl.when(j == g.steps_k - 1)
    def _finish():
        _scaled(g, dq_scr)
        ops.write_rows(dq_ref, dq_scr)


def dq_call(
    g: Geometry,
    q,
    k,
    v,
    do,
    lse,
    di,
    bias,
    mask,
    q_seg,
    kv_seg,
    tables,
    *,
    interpret,
    ops: Operands,
    vmem_limit=None,
):
    """dQ (+ bias gradient) kernel on padded operands in ``ops``'s layout.

    Returns ``(dq, [dbias_tiles])``: ``dq`` in ``q``'s layout and, with a bias, f32 tiles
    [B, Hq, nq, nk, rq, rk] (see :func:`dbias_block`) that the caller reduces to the bias shape.
    ``lse``/``di`` are f32 rows [B, Hq, nq, 1, bq]; ``tables`` is the call's row-major
    :class:`~flashport.kernels.backends.pallas_tpu.tiling.Tables`.
    """
    b, hq, hkv = ops.batch(q), ops.heads(q), ops.heads(k)
    dp, dvp = q.shape[-1], v.shape[-1]
    heads = hq if ops.token_major else g.head_block * (hq // hkv)
    maps, in_specs = grouped_specs(g, ops, q, k, v, bias, mask, q_seg is not None, grads=True)
    operands = [q, k, v, do, lse, di, bias, mask, q_seg, kv_seg]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [ops.spec(heads, g.bq, dp, maps.q)]
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
                (_SQ, heads, _SQ, _SQ, rq, rk),
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
            + 2 * b * hq * g.sqp * 4
            + b * hkv * g.visited_tiles * g.bk * (dp + dvp) * itemsize
            + (tiles * block[0] * block[1] * 4 * 2 if block else 0)
        ),
    )
    return pl.pallas_call(
        functools.partial(
            _dq_kernel,
            g=g,
            lay=_grad_layout(g, ops, heads, hq, bias, mask, q_seg is not None),
            dbias_block=block,
        ),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, 1 if ops.token_major else hkv // g.head_block, g.nq, g.steps_k),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((heads, g.bq, dp), jnp.float32),
                *ops.stage_shapes(hq, g.bq, [(dp, q.dtype), (dvp, do.dtype)]),
                *ops.stage_shapes(hkv, g.bk, [(dp, k.dtype), (dvp, v.dtype)]),
            ],
        ),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="flashport_flash_dq",
    )(tables, *operands, zeros)
