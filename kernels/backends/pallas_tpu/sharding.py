"""Run the Pallas TPU attention kernels on sharded inputs without the user writing a ``shard_map``.

A ``pallas_call`` lowers to one opaque custom call that neither GSPMD nor Shardy can split, and JAX
refuses to lower it under a multi-device partitioner ("Mosaic kernels cannot be automatically
partitioned"). :func:`partitioned` wraps a per-shard function in
``jax.experimental.custom_partitioning``: the partitioner keeps the batch and head sharding of the
query (and the matching kv-head sharding for GQA), gathers everything else (sequence, head_dim),
and calls the function on each shard. Attention is independent across batch and heads, so no
communication is needed. Heads are only kept sharded when the kv heads split evenly too (for MQA
with one kv head, the heads are gathered); sequence sharding is gathered (flash attention along a
sharded sequence needs ring attention, which this backend does not do).

With one device (the usual case, and ``jax.export`` for a single chip) the wrapper is skipped.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# Argument roles per call kind: which arguments carry a batch dim (dim 0) and which a head dim (dim 1):
# "q" = query heads, "kv" = kv heads, "bias" = query heads or broadcast, None = no head dim.
_ROLES = {
    "fwd": ("q", "kv", "kv", "bias", "bias", None, None, "q"),
    "bwd": ("q", "kv", "kv", "bias", "bias", None, None, "q", "q", "q", "q", "q"),
}
_OUT_ROLES = {"fwd": ("q", "q"), "bwd": ("q", "kv", "kv", "bias")}


def partitioned(fn, kind: str):
    """Wrap ``fn(*arrays)`` (arrays may be ``None``) so it runs per batch/head shard.

    ``kind`` is ``"fwd"`` (args q, k, v, bias, mask, q_seg, kv_seg, head_seeds -> out, lse) or
    ``"bwd"`` (args q..kv_seg, out, lse, d_out, d_lse, head_seeds -> dq, dk, dv, dbias). The dropout
    ``head_seeds`` [B, Hq] are sharded like the query's batch and heads, so each shard hashes global
    (batch, head) indices.
    """

    def call(*args):
        if jax.device_count() == 1:
            return fn(*args)
        present = tuple(a is not None for a in args)
        arrays = [a for a in args if a is not None]
        return _wrapper(
            fn, kind, present, tuple(a.shape for a in arrays), tuple(str(a.dtype) for a in arrays)
        )(*arrays)

    return call


def _names(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _axes_size(mesh, axes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def _choose(mesh, q_sharding, q_shape, kv_heads):
    """Mesh axes to keep for the batch and head dims, from the query's sharding."""
    spec = tuple(q_sharding.spec) + (None,) * 4 if isinstance(q_sharding, NamedSharding) else (None,) * 4
    batch_axes, head_axes = spec[0], spec[1]
    if batch_axes is not None and q_shape[0] % _axes_size(mesh, batch_axes):
        batch_axes = None
    if head_axes is not None and (
        kv_heads % _axes_size(mesh, head_axes) or q_shape[1] % _axes_size(mesh, head_axes)
    ):
        head_axes = None
    return batch_axes, head_axes


def _spec_for(role, shape, batch, heads, batch_axes, head_axes):
    if role is None:  # segment ids [B, S]
        dims = [batch_axes if shape[0] == batch and shape[0] > 1 else None] + [None] * (len(shape) - 1)
        return PartitionSpec(*dims)
    dims = [None] * len(shape)
    if shape[0] == batch and batch > 1:
        dims[0] = batch_axes
    if shape[1] > 1 and (role in ("q", "kv") or (role == "bias" and shape[1] == heads)):
        dims[1] = head_axes
    return PartitionSpec(*dims)


def _factors(role, shape, batch, heads, prefix, counter) -> str:
    """The Shardy factor names of one operand's dims: 'b' for the batch, 'h' for query heads (of q
    and a per-head bias), 'n' for kv heads, and every other dim a factor of its own
    (``prefix`` and the next number of ``counter``)."""
    names = []
    for axis, size in enumerate(shape):
        if axis == 0 and size == batch:
            names.append("b")
        elif axis == 1 and role in ("q", "bias") and size == heads and size > 1:
            names.append("h")
        elif axis == 1 and role == "kv":
            names.append("n")
        else:
            names.append(f"{prefix}{next(counter)}")
    return " ".join(names)


@functools.cache
def _rule(kind, present, shapes):
    """A Shardy rule: batch 'b', query heads 'h', kv heads 'n'; every other dim its own factor."""
    roles = [r for r, p in zip(_ROLES[kind], present, strict=False) if p]
    q_shape, kv_shape = shapes[0], shapes[1]
    batch, heads, kv_heads = q_shape[0], q_shape[1], kv_shape[1]
    counter = iter(range(10_000))
    ins = [_factors(r, s, batch, heads, "x", counter) for r, s in zip(roles, shapes, strict=False)]
    return ins, batch, heads, kv_heads, roles


def _wrapper(fn, kind, present, shapes, dtypes):
    ins, batch, heads, kv_heads, roles = _rule(kind, present, shapes)
    n_out = len(_OUT_ROLES[kind])

    def with_nones(arrays):
        it = iter(arrays)
        return [next(it) if p else None for p in present]

    def out_shapes_of(arrays_shapes):
        return jax.eval_shape(lambda *a: fn(*with_nones(a)), *arrays_shapes)

    out_structs = out_shapes_of([jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=False)])
    out_shapes = [None if o is None else o.shape for o in out_structs]

    def out_rule():
        names = []
        counter = iter(range(10_000))
        for role, shape in zip(_OUT_ROLES[kind], out_shapes, strict=False):
            if shape is not None:
                names.append(_factors(role, shape, batch, heads, "y", counter))
        return names

    def shardings(mesh, arg_shapes):
        batch_axes, head_axes = _choose(mesh, arg_shapes[0].sharding, shapes[0], kv_heads)
        args = [
            NamedSharding(mesh, _spec_for(r, s, batch, heads, batch_axes, head_axes))
            for r, s in zip(roles, shapes, strict=False)
        ]
        outs = [
            NamedSharding(mesh, _spec_for(r, s, batch, heads, batch_axes, head_axes))
            for r, s in zip(_OUT_ROLES[kind], out_shapes, strict=False)
            if s is not None
        ]
        return args, outs

    def infer(mesh, arg_shapes, result_shape):
        _, outs = shardings(mesh, arg_shapes)
        return tuple(outs) if n_out > 1 else outs[0]

    def partition(mesh, arg_shapes, result_shape):
        args, outs = shardings(mesh, arg_shapes)

        batch_axes, head_axes = _choose(mesh, arg_shapes[0].sharding, shapes[0], kv_heads)
        # A broadcast bias's gradient sums over the batch/heads it was broadcast along: each shard
        # holds a partial sum over its own batch/heads, so reduce across those mesh axes.
        reduce_axes = ()
        if kind == "bwd" and present[3]:
            bias_shape = shapes[sum(present[:3])]
            if bias_shape[0] == 1 and batch > 1 and batch_axes is not None:
                reduce_axes += _names(batch_axes)
            if bias_shape[1] == 1 and heads > 1 and head_axes is not None:
                reduce_axes += _names(head_axes)

        def lower(*arrays):
            res = list(fn(*with_nones(arrays)))
            if reduce_axes:
                res[-1] = jax.lax.psum(res[-1], reduce_axes)
            return tuple(r for r in res if r is not None)

        return mesh, lower, tuple(outs), tuple(args)

    def impl(*arrays):
        res = fn(*with_nones(arrays))
        return tuple(r for r in res if r is not None)

    # custom_partitioning rejects closed-over constants (the kernels' static block tables), so they
    # become extra, replicated operands; the per-shard ``lower`` rebuilds its own.
    closed = jax.make_jaxpr(impl)(*[jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=False)])
    consts = [jax.numpy.asarray(c) for c in closed.consts]
    n = len(shapes)

    def impl_with_consts(*operands):
        return tuple(jax.core.eval_jaxpr(closed.jaxpr, operands[n:], *operands[:n]))

    const_rule = "".join(f", {' '.join(f'c{i}_{a}' for a in range(c.ndim))}" for i, c in enumerate(consts))
    full_rule = ", ".join(ins) + const_rule + " -> " + ", ".join(out_rule())

    def partition_all(mesh, arg_shapes, result_shape):
        mesh, lower, outs, args = partition(mesh, arg_shapes[:n], result_shape)
        replicated = tuple(NamedSharding(mesh, PartitionSpec()) for _ in consts)
        return mesh, lambda *ops: lower(*ops[:n]), outs, args + replicated

    def infer_all(mesh, arg_shapes, result_shape):
        return infer(mesh, arg_shapes[:n], result_shape)

    wrapped = custom_partitioning(impl_with_consts)
    wrapped.def_partition(
        infer_sharding_from_operands=infer_all, partition=partition_all, sharding_rule=full_rule
    )

    def run(*arrays):
        res = iter(wrapped(*arrays, *consts))
        return tuple(next(res) if s is not None else None for s in out_shapes)

    return run
