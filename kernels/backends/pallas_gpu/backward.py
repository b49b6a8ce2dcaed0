"""The Pallas GPU (Triton) backward kernels: dK/dV and dQ (+ bias gradient), FlashAttention-2 split.

Both recompute the probabilities of each tile from the saved ``lse`` (O(S) residuals) and regenerate
the dropout mask from the position hash. With ``delta = rowsum(dO * O) - dlse`` (the lse cotangent
folds into it), ``dlogits = P * (dropout(dO·Vᵀ) - delta)`` and ``dS = dlogits * softcap'(raw) * scale``.

* dK/dV: one program per (key block, batch, kv head). It loops over the G query heads that share the
  kv head and, for each, over only the query blocks that can see the key block
  (:func:`~flashport.kernels.backends.pallas_gpu.tiling.query_block_bounds`), so GQA needs no atomics and no
  repeated K/V.
* dQ: one program per (query block, batch, query head), looping over the forward's key blocks. It
  also writes the bias gradient (``dlogits``) in the layout :func:`dbias_layout` names; the caller
  reduces it to the bias's broadcast shape.

With segment ids both skip the tiles whose query and key id ranges do not meet
(:func:`~flashport.kernels.backends.pallas_gpu.tiling.segment_visit`); the dQ kernel writes a zero bias gradient
for them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashport.kernels.backends.pallas_gpu.forward import (
    key_slices,
    present_operands,
    row_operands,
    whole_spec,
)
from flashport.kernels.backends.pallas_gpu.tiling import (
    Geometry,
    apply_dropout,
    dot,
    full_key_blocks,
    full_query_blocks,
    key_block_bounds,
    mod_arrays,
    mod_classes,
    mod_grad,
    query_block_bounds,
    segment_visit,
    split_loop,
    tile_logits,
)
from flashport.kernels.contract.spec import softcap_grad


def dbias_layout(bias_shape) -> str | None:
    """How the dQ kernel emits the bias gradient for a bias of ``bias_shape`` (padded, rank 4).

    ``"full"``: [B, Hq, sqp, skp] tiles; ``"keys"`` (bias broadcast over queries): per query block
    column sums [B, Hq, nq, skp]; ``"rows"`` (bias broadcast over keys): row sums [B, Hq, sqp].
    """
    if bias_shape is None:
        return None
    if bias_shape[3] == 1:
        return "rows"
    return "full" if bias_shape[2] > 1 else "keys"


def _dlogits(g: Geometry, q, k, v, do, lse, delta, rows, i, j, **sides):
    """``(p_dropped, dlogits, ds)`` of tile (i, j), all float32 [bq, bk]; ``dlogits`` is pulled back
    through the score_mod when the call has one."""
    logits, raw = tile_logits(g, q, k, i, j, **sides)
    p = jnp.exp(logits - jnp.where(lse == -jnp.inf, 0.0, lse)[:, None])
    dp = apply_dropout(g, dot(do, v, trans_b=True), rows, j)
    dlogits = p * (dp - delta[:, None])
    mod = mod_grad(g, raw, sides.get("bias"), i, j, sides.get("at"))
    if mod is not None:
        dlogits = jnp.where(p > 0, dlogits * mod, 0.0)
    grad = softcap_grad(g.spec, raw, jnp)
    ds = (dlogits if grad is None else dlogits * grad) * g.spec.scale
    return apply_dropout(g, p, rows, j), dlogits, ds


def _dq_kernel(*refs, g: Geometry, names, layout):
    r = dict(zip(names + ("dq_out", "dbias_out")[: 1 + (layout is not None)], refs, strict=False))
    i = pl.program_id(0)
    q, do, lse, delta = r["q"][...], r["do"][...], r["lse"][...], r["delta"][...]
    q_seg = r["q_seg"][...] if "q_seg" in r else None
    rows = r["rows"][...] if "rows" in r else None
    lo, hi = key_block_bounds(g, i)
    at = (mod_arrays(g, r), pl.program_id(1), pl.program_id(2))

    def zero(j, carry):  # the bias gradient of a key block the kernel does not compute
        ks = pl.ds(j * g.bk, g.bk)
        if layout == "full":
            r["dbias_out"][:, ks] = jnp.zeros((g.bq, g.bk), jnp.float32)
        elif layout == "keys":
            r["dbias_out"][ks] = jnp.zeros((g.bk,), jnp.float32)
        return carry

    if layout in ("full", "keys"):  # key blocks the loop never visits
        jax.lax.fori_loop(0, lo, zero, None)
        jax.lax.fori_loop(hi, g.nk, zero, None)

    def body(j, carry, positional, mask_mod=True):
        dq, db = carry
        ks = pl.ds(j * g.bk, g.bk)
        k = r["k"][ks, :]
        _, dlogits, ds = _dlogits(
            g,
            q,
            k,
            r["v"][ks, :],
            do,
            lse,
            delta,
            rows,
            i,
            j,
            q_seg=q_seg,
            positional=positional,
            at=at,
            mask_mod=mask_mod,
            **key_slices(r, ks),
        )
        dq = dq + dot(ds.astype(k.dtype), k)
        if layout == "full":
            r["dbias_out"][:, ks] = dlogits
        elif layout == "keys":
            r["dbias_out"][ks] = jnp.sum(dlogits, axis=0)
        elif layout == "rows":
            db = db + jnp.sum(dlogits, axis=1)
        return dq, db

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros((g.bq,), jnp.float32))
    visit = segment_visit(q_seg, lambda j: r["kv_seg"][pl.ds(j * g.bk, g.bk)])
    classes = mod_classes(g, r, at[1], q_block=i)
    dq, db = split_loop((lo, hi), full_key_blocks(g, i), body, init, visit, zero, classes)
    r["dq_out"][...] = dq.astype(r["dq_out"].dtype)
    if layout == "rows":
        r["dbias_out"][...] = db


def dq_call(g: Geometry, named: dict, *, group: int, interpret: bool, num_warps: int, num_stages: int):
    """Run the dQ kernel on padded operands (``q k v do lse delta`` plus the optional ones of
    :func:`~flashport.kernels.backends.pallas_gpu.forward.row_operands`); returns ``(dq, dbias_tiles or None)``."""
    q = named["q"]
    b, hq = q.shape[:2]
    names, arrays, in_specs = row_operands(g, group, named)
    layout = dbias_layout(None if named.get("bias") is None else named["bias"].shape)
    out_specs = [pl.BlockSpec((None, None, g.bq, q.shape[3]), lambda i, b, h: (b, h, i, 0))]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if layout == "full":
        out_specs.append(pl.BlockSpec((None, None, g.bq, g.skp), lambda i, b, h: (b, h, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hq, g.sqp, g.skp), jnp.float32))
    elif layout == "keys":
        out_specs.append(pl.BlockSpec((None, None, None, g.skp), lambda i, b, h: (b, h, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hq, g.nq, g.skp), jnp.float32))
    elif layout == "rows":
        out_specs.append(pl.BlockSpec((None, None, g.bq), lambda i, b, h: (b, h, i)))
        out_shape.append(jax.ShapeDtypeStruct((b, hq, g.sqp), jnp.float32))
    res = pl.pallas_call(
        functools.partial(_dq_kernel, g=g, names=names, layout=layout),
        grid=(g.nq, b, hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="flashport_gpu_dq",
    )(*arrays)
    return res[0], (res[1] if layout is not None else None)


def _group_operands(g: Geometry, group: int, named: dict):
    """``(names, arrays, in_specs)`` for a grid (key block ``j``, batch ``b``, kv head ``h``): per
    program q/do [G, sqp, D], lse/delta/rows [G, sqp], k/v [bk, D], bias/mask [G|1, sqp|1, bk|1],
    q_seg [sqp], kv_seg [bk]."""

    def spec_for(name, x):
        if name in ("q", "do"):
            return pl.BlockSpec((None, group, x.shape[2], x.shape[3]), lambda j, b, h: (b, h, 0, 0))
        if name in ("k", "v"):
            return pl.BlockSpec((None, None, g.bk, x.shape[3]), lambda j, b, h: (b, h, j, 0))
        if name in ("lse", "delta", "rows"):
            return pl.BlockSpec((None, group, x.shape[2]), lambda j, b, h: (b, h, 0))
        if name in ("bias", "mask"):
            fb, fh, _, fk = (n > 1 for n in x.shape)
            return pl.BlockSpec(
                (None, group if fh else 1, x.shape[2], g.bk if fk else 1),
                lambda j, b, h: (b if fb else 0, h if fh else 0, 0, j if fk else 0),
            )
        if name == "q_seg":
            return pl.BlockSpec((None, x.shape[1]), lambda j, b, h: (b, 0))
        if name == "kv_seg":
            return pl.BlockSpec((None, g.bk), lambda j, b, h: (b, j))
        return whole_spec(name, x)

    return present_operands(named, spec_for)


def _query_side(refs: dict, name: str, head, qs):
    """The [bq|1, bk|1] slice of bias/mask for query head ``head`` of the group and query slice ``qs``."""
    ref = refs.get(name)
    if ref is None:
        return None
    h = head if ref.shape[0] > 1 else 0
    return ref[h, qs, :] if ref.shape[1] > 1 else ref[h, :, :]


def _dkv_kernel(*refs, g: Geometry, names, group: int):
    r = dict(zip(names + ("dk_out", "dv_out"), refs, strict=False))
    j = pl.program_id(0)
    k, v = r["k"][...], r["v"][...]
    kv_seg = r["kv_seg"][...] if "kv_seg" in r else None
    bounds, full = query_block_bounds(g, j), full_query_blocks(g, j)
    visit = segment_visit(kv_seg, lambda i: r["q_seg"][pl.ds(i * g.bq, g.bq)])
    consts, bi, hk = mod_arrays(g, r), pl.program_id(1), pl.program_id(2)
    classes = mod_classes(g, r, bi, k_block=j)

    def head(h, carry):
        def body(i, carry, positional, mask_mod=True):
            dk, dv = carry
            qs = pl.ds(i * g.bq, g.bq)
            q, do = r["q"][h, qs, :], r["do"][h, qs, :]
            p, _, ds = _dlogits(
                g,
                q,
                k,
                v,
                do,
                r["lse"][h, qs],
                r["delta"][h, qs],
                r["rows"][h, qs] if "rows" in r else None,
                i,
                j,
                bias=_query_side(r, "bias", h, qs),
                mask=_query_side(r, "mask", h, qs),
                q_seg=r["q_seg"][qs] if "q_seg" in r else None,
                kv_seg=kv_seg,
                positional=positional,
                at=(consts, bi, hk * group + h),
                mask_mod=mask_mod,
            )
            dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
            dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)
            return dk, dv

        return split_loop(bounds, full, body, carry, visit, classes=classes)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(0, group, head, init)
    r["dk_out"][...] = dk.astype(r["dk_out"].dtype)
    r["dv_out"][...] = dv.astype(r["dv_out"].dtype)


def dkv_call(g: Geometry, named: dict, *, group: int, interpret: bool, num_warps: int, num_stages: int):
    """Run the dK/dV kernel on padded operands; returns padded ``(dk, dv)`` in k's and v's dtypes."""
    k, v = named["k"], named["v"]
    b, hkv = k.shape[:2]
    names, arrays, in_specs = _group_operands(g, group, named)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, g=g, names=names, group=group),
        grid=(g.nk, b, hkv),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, g.bk, k.shape[3]), lambda j, b, h: (b, h, j, 0)),
            pl.BlockSpec((None, None, g.bk, v.shape[3]), lambda j, b, h: (b, h, j, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="flashport_gpu_dkv",
    )(*arrays)
