"""Instrumentation of the Pallas TPU forward kernel: what it evaluates and fetches, counted.

Three counts, each taken from the kernel itself rather than from a formula:

* **tiles per class** (:func:`tile_counts`): the forward runs in the TPU interpreter with two
  counters, one per tile body (mask-free / masked), summed over the grid;
* **mask operations per tile** (:func:`mask_ops_per_tile`): the forward's kernel jaxpr (what Pallas
  lowers to Mosaic) is walked and the iota / compare / logical / select operations over a
  ``[bq, bk]`` tile are counted inside each tile body's named scope (the online-softmax update and
  dropout, which have their own scopes, are not masking); evaluated mask ops = ops per tile x tiles;
* **K/V block fetches** (:func:`kv_block_fetches`): the kernel's K/V index map is evaluated over the
  whole grid in grid order; the TPU pipeline issues a DMA only when the block index changes
  between consecutive steps, so the fetches are the number of changes (+1). ``grouped=False``
  evaluates the per-query-head index map of the previous forward kernel (the dQ kernel's, grid
  ``(B, Hq, nq, steps_k)``) on the same tables: the "before" of the GQA change.

* **dQ K/V block fetches** (:func:`kv_block_fetches` on :func:`dq_geometry`): the dQ kernel walks
  the forward's grouped grid, so the same count applies with the dQ kernel's blocks;
* **lse bytes written** (:func:`lse_bytes_written`): the forward ``pallas_call``'s f32 outputs besides
  ``out``, read off the traced program of a ``flashport.attention`` call (inference or gradient).

``benchmarks/tpu_counts.py`` prints these next to the analytic model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashport.kernels.backends.pallas_tpu import backend
from flashport.kernels.backends.pallas_tpu.blocks import resolve_blocks
from flashport.kernels.backends.pallas_tpu.classify import FULL_SCOPE, PARTIAL_SCOPE, UNCOUNTED_SCOPES
from flashport.kernels.backends.pallas_tpu.specs import GroupMajor, QueryMajor
from flashport.kernels.backends.pallas_tpu.tiling import Geometry, block_tables
from flashport.kernels.contract import api, registry
from flashport.kernels.contract.spec import AttentionSpec

MASK_PRIMITIVES = frozenset({"iota", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "select_n"})


@dataclasses.dataclass(frozen=True)
class TileCounts:
    """Head tiles (key block x query head) the forward computed, per class, summed over the grid."""

    full: int
    partial: int


def forward_geometry(spec: AttentionSpec, q, k, v, options=None) -> Geometry:
    """The forward kernel's geometry for these operands and ``options`` (generation defaults)."""
    return _config(spec, options).geometry("fwd", q, k, v)


def tile_counts(q, k, v, *, spec: AttentionSpec, options=None, classify=True, **arrays) -> TileCounts:
    """Run the forward in the interpreter with its class counters; ``arrays``: bias/mask/q_seg/kv_seg.

    ``classify=False`` counts the previous kernel's behaviour (every tile through the masked body).
    """
    _, _, full, partial = backend.count_tiles_by_class(
        q, k, v, spec=spec, options=options, classify=classify, **arrays
    )
    return TileCounts(int(np.sum(full)), int(np.sum(partial)))


def forward_kernel_jaxpr(q, k, v, *, spec: AttentionSpec, options=None, classify=True, **arrays):
    """The jaxpr of the forward ``pallas_call``'s kernel body (what Pallas lowers for the TPU).

    ``classify=False``: the kernel as it was before tile classification (masked body only).
    """
    cfg = _config(spec, options)

    def fn(q, k, v):
        return backend._forward_local(cfg, q, k, v, *_optional(arrays), classify=classify)

    return _kernel_jaxpr(jax.make_jaxpr(fn)(q, k, v), "flashport_flash_fwd")


def backward_kernel_jaxprs(q, k, v, *, spec: AttentionSpec, options=None, **arrays) -> dict:
    """The kernel jaxprs of the backward: ``{"dkv": jaxpr, "dq": jaxpr}`` (traced, not run)."""
    cfg = _config(spec, options)
    b, hq, sq, _ = q.shape
    out = jnp.zeros((b, hq, sq, v.shape[3]), q.dtype)
    lse = jnp.zeros((b, hq, sq), jnp.float32)

    def fn(q, k, v):
        return backend._backward_local(cfg, q, k, v, *_optional(arrays), out, lse, out, lse, None)

    closed = jax.make_jaxpr(fn)(q, k, v)
    return {kind: _kernel_jaxpr(closed, f"flashport_flash_{kind}") for kind in ("dkv", "dq")}


def dq_geometry(spec: AttentionSpec, q, k, v, options=None) -> Geometry:
    """The dQ kernel's geometry for canonical operands and ``options`` (its blocks fit the group's VMEM)."""
    return _config(spec, options).geometry("dq", q, k, v)


def lse_bytes_written(q, k, v, *, grad: bool, options=None, **kwargs) -> int:
    """Bytes of the lse the forward kernel writes to HBM for ``flashport.attention(q, k, v, **kwargs)``.

    Traced, not run: the forward ``pallas_call``'s outputs other than ``out`` (and the tile counters)
    summed. ``grad=True`` traces ``jax.grad`` of the call (its forward must save the lse).
    """
    choice = registry.use("pallas_tpu_interpret", **(options or {}))

    def fwd(q, k, v):
        return api.attention(q, k, v, backend=choice, **kwargs)

    def loss(q, k, v):
        out = fwd(q, k, v)
        return jnp.sum((out[0] if isinstance(out, tuple) else out).astype(jnp.float32))

    closed = jax.make_jaxpr(jax.grad(loss) if grad else fwd)(q, k, v)
    for eqn, _ in _walk(closed.jaxpr, ""):
        if eqn.primitive.name == "pallas_call" and eqn.params["name"] == "flashport_flash_fwd":
            return sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.outvars[1:])
    raise LookupError("no flashport_flash_fwd pallas_call in the traced call")


def _config(spec: AttentionSpec, options) -> backend.Config:
    _, blocks = resolve_blocks(dict(options or {}), "pallas_tpu_interpret")
    return backend.Config(spec, blocks, interpret=True)


def _optional(arrays):
    """``bias, mask, q_seg, kv_seg`` from the keyword arrays (``None`` where absent)."""
    return tuple(arrays.get(n) for n in ("bias", "mask", "q_seg", "kv_seg"))


def _kernel_jaxpr(closed, name: str):
    for eqn, _ in _walk(closed.jaxpr, ""):
        if eqn.primitive.name == "pallas_call" and eqn.params["name"] == name:
            return eqn.params["jaxpr"]
    raise LookupError(f"no {name} pallas_call in the traced function")


def mask_ops_per_tile(kernel_jaxpr, bq: int, bk: int) -> dict[str, int]:
    """Mask operations over a ``[bq, bk]`` tile in each tile body: ``{"full": n, "partial": n}``.

    Counts equations of :data:`MASK_PRIMITIVES` with a ``[bq, bk]`` output (or ``[bk, bq]``: the
    dK/dV kernel's key-major tiles) inside the body's named scope, outside the online-softmax and
    dropout scopes. A body the kernel does not build counts 0.
    """
    counts = {"full": 0, "partial": 0}
    tiles = {(bq, bk), (bk, bq)}
    for eqn, stack in _walk(kernel_jaxpr, ""):
        if eqn.primitive.name not in MASK_PRIMITIVES or any(s in stack for s in UNCOUNTED_SCOPES):
            continue
        if not any(tuple(getattr(v.aval, "shape", ())) in tiles for v in eqn.outvars):
            continue
        if FULL_SCOPE in stack:
            counts["full"] += 1
        elif PARTIAL_SCOPE in stack:
            counts["partial"] += 1
    return counts


def _walk(jaxpr, stack: str):
    """Yield ``(eqn, name stack)`` for every equation, descending into sub-jaxprs (stacks accumulate)."""
    for eqn in jaxpr.eqns:
        here = f"{stack}/{eqn.source_info.name_stack}"
        yield eqn, here
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk(inner, here)


def kv_block_fetches(
    g: Geometry, batch: int, hq: int, hkv: int, q_seg=None, kv_seg=None, *, grouped=True
) -> int:
    """K (equally V) blocks of one kv head the forward fetches: block-index changes in grid order, + 1.

    ``grouped=True`` evaluates the kernel's index map over one kv head per step (grid ``(B, Hkv, nq,
    steps_k)``; with a head block the kernel fetches the blocks of its ``head_block`` kv heads in one
    DMA, the same blocks), ``False`` the
    per-query-head map of the previous kernel (grid ``(B, Hq, nq, steps_k)``, kv head ``h // G``).
    """
    group = hq // hkv
    maps = GroupMajor(g, group) if grouped else QueryMajor(g, group)
    tables = block_tables(g, q_seg, kv_seg, by_rows=True)
    grid = np.indices((batch, hkv if grouped else hq, g.nq, g.steps_k)).reshape(4, -1)
    bi, h, i, j = (jnp.asarray(a) for a in grid)
    blocks = maps.kv(bi, h, i, j, tables)
    index = np.stack([np.broadcast_to(np.asarray(x), grid.shape[1:]) for x in blocks])
    return 1 + int(np.sum(np.any(index[:, 1:] != index[:, :-1], axis=0)))


def kernel_block_shapes(kernel_jaxpr) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The VMEM block shapes of q ``[G, bq, Dp]``, k ``[bk, Dp]`` and v ``[bk, Dvp]`` in the kernel (k and v
    ``[hb, bk, D]`` with a head block of hb kv heads).

    Read from the kernel's own refs (after the rank-1 scalar-prefetch tables, the first three refs).
    """
    shapes = [tuple(v.aval.shape) for v in kernel_jaxpr.invars if len(getattr(v.aval, "shape", ())) >= 2]
    return shapes[0], shapes[1], shapes[2]


def padded_macs(kernel_jaxpr, counts: TileCounts) -> int:
    """Multiply-accumulates the forward executed: head tiles x ``bq x bk x (Dp + Dvp)`` (padding included)."""
    (_, bq, dp), (*_, bk, _), (*_, dvp) = kernel_block_shapes(kernel_jaxpr)
    return (counts.full + counts.partial) * bq * bk * (dp + dvp)
