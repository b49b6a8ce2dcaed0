"""The Pallas GPU (Triton) forward kernel: one program per (query block, batch, query head).

Each program keeps its query block in registers and loops over only the key blocks that
causal/window structure leaves visible (:func:`~flashport.kernels.backends.pallas_gpu.tiling.key_block_bounds`),
carrying the float32 online-softmax state; interior blocks every query sees whole
(:func:`~flashport.kernels.backends.pallas_gpu.tiling.full_key_blocks`) skip the position masking, and with
segment ids, key blocks whose id range misses the query block's are skipped
(:func:`~flashport.kernels.backends.pallas_gpu.tiling.segment_visit`). K/V are read through an index map that sends query head
``h`` to kv head ``h // G`` (GQA/MQA without repeating K/V). Outputs: ``out`` and the natural-log
``lse`` (``-inf`` for rows that see no key; their ``out`` is 0).

:func:`row_operands` builds the operand list and BlockSpecs shared with the dQ kernel, whose grid
has the same (query block, batch, query head) shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashport.kernels.backends.pallas_gpu.tiling import (
    Geometry,
    apply_dropout,
    dot,
    full_key_blocks,
    key_block_bounds,
    mod_arrays,
    mod_classes,
    segment_visit,
    split_loop,
    tile_logits,
)


def whole_spec(name: str, x):
    """The BlockSpec of an operand every program reads whole: the user mods' arrays (``mod<n>``) and
    their block mask's tile classes (``mod_classes``)."""
    if not name.startswith("mod"):
        raise AssertionError(name)
    return pl.BlockSpec(x.shape, lambda *grid: (0,) * x.ndim)


def present_operands(named: dict, spec_for) -> tuple[tuple[str, ...], list, list]:
    """``(names, arrays, in_specs)`` of the operands in ``named`` that are present (not None), in
    order, each with its BlockSpec ``spec_for(name, array)``."""
    names, arrays, specs = [], [], []
    for name, x in named.items():
        if x is not None:
            names.append(name)
            arrays.append(x)
            specs.append(spec_for(name, x))
    return tuple(names), arrays, specs


def row_operands(g: Geometry, group: int, named: dict):
    """``(names, arrays, in_specs)`` for a grid (query block ``i``, batch ``b``, query head ``h``).

    ``named`` maps operand names to padded arrays (absent operands are None or missing):
    ``q``/``do`` [B, Hq, sqp, D], ``k``/``v`` [B, Hkv, skp, D], ``lse``/``delta``/``rows``
    [B, Hq, sqp], ``bias``/``mask`` [B|1, Hq|1, sqp|1, skp|1], ``q_seg`` [B, sqp], ``kv_seg`` [B, skp].
    Per program the kernel sees: q/do [bq, D], k/v [skp, D], lse/delta/rows [bq], bias/mask
    [bq|1, skp|1], q_seg [bq], kv_seg [skp].
    """
    bq = g.bq

    def spec_for(name, x):
        if name in ("q", "do"):
            return pl.BlockSpec((None, None, bq, x.shape[3]), lambda i, b, h: (b, h, i, 0))
        if name in ("k", "v"):
            return pl.BlockSpec((None, None, x.shape[2], x.shape[3]), lambda i, b, h: (b, h // group, 0, 0))
        if name in ("lse", "delta", "rows"):
            return pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
        if name in ("bias", "mask"):
            fb, fh, fq, _ = (n > 1 for n in x.shape)
            return pl.BlockSpec(
                (None, None, bq if fq else 1, x.shape[3]),
                lambda i, b, h: (b if fb else 0, h if fh else 0, i if fq else 0, 0),
            )
        if name == "q_seg":
            return pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
        if name == "kv_seg":
            return pl.BlockSpec((None, x.shape[1]), lambda i, b, h: (b, 0))
        return whole_spec(name, x)

    return present_operands(named, spec_for)


def key_side(refs: dict, name: str, ks):
    """The [bq|1, bk|1] slice of bias/mask for key slice ``ks`` (None when the operand is absent)."""
    ref = refs.get(name)
    if ref is None:
        return None
    return ref[:, ks] if ref.shape[1] > 1 else ref[...]


def key_slices(refs: dict, ks) -> dict:
    """``bias``, ``mask`` and ``kv_seg`` of key slice ``ks`` (None where absent), the key-side
    keywords of :func:`~flashport.kernels.backends.pallas_gpu.tiling.tile_logits`."""
    return {
        "bias": key_side(refs, "bias", ks),
        "mask": key_side(refs, "mask", ks),
        "kv_seg": refs["kv_seg"][ks] if "kv_seg" in refs else None,
    }


def _forward_kernel(*refs, g: Geometry, names):
    r = dict(zip(names + ("out", "lse_out"), refs, strict=False))
    i = pl.program_id(0)
    q = r["q"][...]
    q_seg = r["q_seg"][...] if "q_seg" in r else None
    rows = r["rows"][...] if "rows" in r else None
    v_dtype = r["v"].dtype
    at = (mod_arrays(g, r), pl.program_id(1), pl.program_id(2))

    def body(j, carry, positional, mask_mod=True):
        acc, m, l = carry
        ks = pl.ds(j * g.bk, g.bk)
        logits, _ = tile_logits(
            g,
            q,
            r["k"][ks, :],
            i,
            j,
            q_seg=q_seg,
            positional=positional,
            at=at,
            mask_mod=mask_mod,
            **key_slices(r, ks),
        )
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(logits - m_safe[:, None])
        l = alpha * l + jnp.sum(p, axis=1)  # the normalizer counts dropped entries too
        pv = dot(apply_dropout(g, p, rows, j).astype(v_dtype), r["v"][ks, :])
        return alpha[:, None] * acc + pv, m_new, l

    init = (
        jnp.zeros((g.bq, r["v"].shape[1]), jnp.float32),
        jnp.full((g.bq,), -jnp.inf, jnp.float32),
        jnp.zeros((g.bq,), jnp.float32),
    )
    visit = segment_visit(q_seg, lambda j: r["kv_seg"][pl.ds(j * g.bk, g.bk)])
    classes = mod_classes(g, r, at[1], q_block=i)
    acc, m, l = split_loop(key_block_bounds(g, i), full_key_blocks(g, i), body, init, visit, classes=classes)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    r["out"][...] = (acc / l_safe[:, None]).astype(r["out"].dtype)
    r["lse_out"][...] = jnp.where(seen, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(l_safe), -jnp.inf)


def forward_call(
    g: Geometry, named: dict, *, group: int, out_dtype, interpret: bool, num_warps: int, num_stages: int
):
    """Run the forward kernel on padded operands (see :func:`row_operands`); returns padded
    ``(out [B, Hq, sqp, Dv], lse float32 [B, Hq, sqp])``."""
    q, v = named["q"], named["v"]
    b, hq = q.shape[:2]
    names, arrays, in_specs = row_operands(g, group, named)
    dvp = v.shape[3]
    return pl.pallas_call(
        functools.partial(_forward_kernel, g=g, names=names),
        grid=(g.nq, b, hq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, g.bq, dvp), lambda i, b, h: (b, h, i, 0)),
            pl.BlockSpec((None, None, g.bq), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hq, g.sqp, dvp), out_dtype),
            jax.ShapeDtypeStruct((b, hq, g.sqp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="flashport_gpu_fwd",
    )(*arrays)
