"""``flashport.attention`` on inputs whose sharding is decided when XLA partitions the program.

Under ``jax.jit`` over a mesh with ``Auto`` axes (``Mesh(devices, ("sp",))`` with ``NamedSharding``
in/out shardings, the usual setup, or ``pjit``-style ``in_shardings``) a traced array carries no
sharding: the partitioner settles it after tracing, so :func:`flashport.kernels.parallel.ring.detect` cannot
see it. :func:`attention` wraps the call in ``jax.experimental.custom_partitioning`` and decides
from the shardings the partitioner gives the operands:

* query and key sharded along their sequence dim over one mesh axis (of size > 1 that divides both
  lengths): each shard runs the ring steps of :mod:`flashport.kernels.parallel.ring` (K/V travel by
  collective-permute, never gathered), keeping any batch and head sharding;
* otherwise: batch and head sharding are kept (attention is independent across them), every other
  dim is gathered, and each shard runs the plain call.

Gradients: a ``custom_vjp`` whose forward and backward are each partitioned that way. The backward
is the residual backward from the forward's ``out`` and ``lse`` (the ring backward, or the backend's
:func:`~flashport.kernels.contract.backward.flashport_attention_backward`), so nothing is recomputed.

With one device, or inside a ``shard_map`` over every mesh axis, the wrapper lowers to the plain
call. ``custom_partitioning`` has no batching rule: under ``vmap`` the mapped axis is folded into
the batch dim (:func:`_batchable`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flashport.kernels.contract import dispatch, execute
from flashport.kernels.contract.call import Call
from flashport.kernels.contract.validate import prepare
from flashport.kernels.parallel import ring


def wanted(query, key) -> bool:
    """True when the sequence sharding of a call can only be known at partition time.

    That is: more than one device, traced (not concrete) arrays whose abstract value names no
    explicit mesh axis, outside a ``shard_map`` (manual axes).
    """
    if jax.device_count() < 2:
        return False
    for x in (query, key):
        if not isinstance(x, jax.core.Tracer) or getattr(x, "ndim", 0) != 4:
            return False
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and any(
            t in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Manual)
            for t in getattr(mesh, "axis_types", ())
        ):
            return False
    return True


def attention(query, key, value, *, backend, return_lse, **contract):
    """:func:`flashport.attention` (no bias, mask or dropout) with the ring decided at partition time."""
    (q, k, v, _, _, q_seg, kv_seg, _), call = prepare(query, key, value, return_lse=True, **contract)
    layout = contract["layout"]
    if layout == "BSHD":  # the partitioned op takes the user's layout: its sequence dim is the sharded one
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    b, sq, sk = call.q_shape[0], call.q_shape[2], call.kv_shape[2]
    if q_seg is not None:
        q_seg, kv_seg = jnp.broadcast_to(q_seg, (b, sq)), jnp.broadcast_to(kv_seg, (b, sk))
    op = _Op(call, backend, layout)
    # Without return_lse a forward that no gradient follows may skip writing the lse (spec.lse_used).
    primal = op if return_lse else dataclasses.replace(op, call=_without_lse(call))
    out, lse = _attention(primal, op, q, k, v, q_seg, kv_seg)
    return (out, lse) if return_lse else out


def _without_lse(call: Call) -> Call:
    return dataclasses.replace(call, features=call.features - {"return_lse"})


@dataclasses.dataclass(frozen=True)
class _Op:
    """The static part of one partitioned call: the global :class:`~flashport.kernels.contract.Call`,
    the backend the user asked for and the user's layout."""

    call: Call
    backend: object
    layout: str

    @property
    def seq_dim(self) -> int:
        return 1 if self.layout == "BSHD" else 2

    @property
    def head_dim(self) -> int:
        return 2 if self.layout == "BSHD" else 1

    def x_spec(self, batch, seq, heads):
        """The partition spec of a [B, S, H, D] / [B, H, S, D] array."""
        dims = [batch, None, None, None]
        dims[self.seq_dim], dims[self.head_dim] = seq, heads
        return P(*dims)

    def local_call(self, q, k, v) -> Call:
        """The Call of one shard (canonical shapes of the shard's arrays)."""
        canon = [jnp.swapaxes(x, 1, 2) if self.layout == "BSHD" else x for x in (q, k, v)]
        return dataclasses.replace(
            self.call,
            q_shape=tuple(canon[0].shape),
            kv_shape=tuple(canon[1].shape),
            v_head_dim=canon[2].shape[-1],
        )

    def canonical(self, *xs):
        """``xs`` in the canonical BHSD layout (BSHD and BHSD swap the same two dims both ways)."""
        return [x if x is None or self.layout == "BHSD" else jnp.swapaxes(x, 1, 2) for x in xs]

    # --------------------------------------------------------------------------- plain shards

    def plain_forward(self, q, k, v, qs, ks):
        """Attention of whole sequences (one shard of the batch/heads, or everything)."""
        call = self.local_call(q, k, v)
        cq, ck, cv = self.canonical(q, k, v)
        choice = execute.resolve_backend(self.backend, call)
        out, lse = dispatch.flashport_attention(
            cq, ck, cv, None, None, qs, ks, None, call=call, choice=choice
        )
        return self.canonical(out)[0], lse

    def plain_backward(self, q, k, v, qs, ks, out, lse, d_out, d_lse):
        """The residual backward of :meth:`plain_forward`: ``(dq, dk, dv)``."""
        call = self.local_call(q, k, v)
        cq, ck, cv, cout, cdo = self.canonical(q, k, v, out, d_out)
        choice = execute.resolve_backend(self.backend, call)
        grads = dispatch.flashport_attention_backward(
            cq, ck, cv, None, None, qs, ks, None, cout, lse, cdo, d_lse, call=call, choice=choice
        )
        return tuple(self.canonical(*grads[:3]))

    # --------------------------------------------------------------------------- ring shards

    def engine(self, mesh, axis):
        plan = ring.Plan.make(self.call.spec, mesh.shape[axis], "contiguous")
        return ring.engine_for(plan, self.call, self.backend, self.layout, mesh)

    def ring_forward(self, mesh, axis, q, k, v, qs, ks):
        return ring._forward(self.engine(mesh, axis), axis, q, k, v, qs, ks)

    def ring_backward(self, mesh, axis, q, k, v, qs, ks, out, lse, d_out, d_lse):
        engine = self.engine(mesh, axis)
        return ring._backward(engine, axis, q, k, v, qs, ks, (), out, lse, d_out, d_lse)[:3]

    # --------------------------------------------------------------------------- the decision

    def axes(self, mesh, q_sharding, k_sharding):
        """``(seq_axis, batch_axes, head_axes)`` to keep, from the operands' shardings."""
        specs = []
        for s in (q_sharding, k_sharding):
            spec = tuple(s.spec) if isinstance(s, NamedSharding) else ()
            specs.append(spec + (None,) * (4 - len(spec)))
        canon = (self.call.q_shape, self.call.kv_shape)
        shapes = [tuple(c[i] for i in ((0, 2, 1, 3) if self.layout == "BSHD" else range(4))) for c in canon]
        return ring.mesh_axes(mesh, specs[0], specs[1], shapes[0], shapes[1], self.layout)


def _attention(primal, op, q, k, v, q_seg, kv_seg):
    """``(out, lse)``: ``primal`` runs when nothing is differentiated, ``op`` (with its lse) and the
    residual backward otherwise."""

    @jax.custom_vjp
    def core(q, k, v, q_seg, kv_seg):
        return _partitioned(primal, "fwd", q, k, v, q_seg, kv_seg)

    def core_fwd(q, k, v, q_seg, kv_seg):
        out, lse = _partitioned(op, "fwd", q, k, v, q_seg, kv_seg)
        return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)

    def core_bwd(res, cotangents):
        d_out, d_lse = cotangents
        q, k, v, q_seg, kv_seg, out, lse = res
        grads = _partitioned(op, "bwd", q, k, v, q_seg, kv_seg, out, lse, d_out.astype(out.dtype), d_lse)
        return (*grads, None, None)

    core.defvjp(core_fwd, core_bwd)
    return core(q, k, v, q_seg, kv_seg)


def _partitioned(op, kind, *args):
    """Run ``kind`` (``"fwd"``: q, k, v, q_seg, kv_seg -> out, lse; ``"bwd"``: those, out, lse,
    d_out, d_lse -> dq, dk, dv) through custom_partitioning. ``None`` segment ids are left out."""
    present = tuple(a is not None for a in args)
    return _batchable(op, kind, present)(*[a for a in args if a is not None])


@functools.cache
def _batchable(op, kind, present):
    """The partitioned op with a batching rule: custom_partitioning has none, so under ``vmap`` the
    mapped axis is folded into the batch dim (every operand has the batch first) and the op runs on
    the flattened batch."""

    @jax.custom_batching.custom_vmap
    def run(*arrays):
        structs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
        return _wrapper(op, kind, present, structs)(*arrays)

    @run.def_vmap
    def rule(axis_size, in_batched, *arrays):
        arrays = [
            x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, b in zip(arrays, in_batched, strict=True)
        ]
        flat = [x.reshape(-1, *x.shape[2:]) for x in arrays]
        b = axis_size * op.call.q_shape[0]
        call = dataclasses.replace(
            op.call, q_shape=(b, *op.call.q_shape[1:]), kv_shape=(b, *op.call.kv_shape[1:])
        )
        outs = _batchable(dataclasses.replace(op, call=call), kind, present)(*flat)
        return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs), (True,) * len(outs)

    return run


@functools.cache
def _wrapper(op, kind, present, structs):
    """The custom_partitioning op of one static call (cached: the partitioner looks its callbacks up)."""
    x_rule = "b s h d", "b t g d", "b t g e"
    roles = {
        "fwd": (*x_rule, "b s", "b t"),
        "bwd": (*x_rule, "b s", "b t", "b s h e", "b h s", "b s h e", "b h s"),
    }
    if op.layout == "BHSD":  # the same factors, heads before sequence
        roles = {kind_: tuple(_bhsd(r) for r in rules) for kind_, rules in roles.items()}
    out_rules = {"fwd": ("b s h e", "b h s"), "bwd": x_rule}
    if op.layout == "BHSD":
        out_rules = {kind_: tuple(_bhsd(r) for r in rules) for kind_, rules in out_rules.items()}
    in_rules = [r for r, p in zip(roles[kind], present, strict=True) if p]

    def with_nones(arrays):
        it = iter(arrays)
        return [next(it) if p else None for p in present]

    def per_shard(mesh, axis):
        if kind == "fwd":
            return op.plain_forward if axis is None else functools.partial(op.ring_forward, mesh, axis)
        return op.plain_backward if axis is None else functools.partial(op.ring_backward, mesh, axis)

    def shardings(mesh, arg_shapes):
        axis, batch, heads = op.axes(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding)
        specs = {
            "b s h d": op.x_spec(batch, axis, heads),
            "b s": P(batch, axis),
            "b h s": P(batch, heads, axis),
        }
        spec_of = {r: specs[_role(r)] for r in (*roles[kind], *out_rules[kind])}
        args = [NamedSharding(mesh, spec_of[r]) for r in in_rules]
        outs = [NamedSharding(mesh, spec_of[r]) for r in out_rules[kind]]
        return axis, args, outs

    def impl(*arrays):
        return tuple(per_shard(None, None)(*with_nones(arrays)))

    # custom_partitioning rejects closed-over constants (the backends' static tables): they become
    # extra, replicated operands; the per-shard function rebuilds its own.
    closed = jax.make_jaxpr(impl)(*structs)
    consts = [jnp.asarray(c) for c in closed.consts]
    n = len(structs)

    def impl_with_consts(*operands):
        return tuple(jax.core.eval_jaxpr(closed.jaxpr, operands[n:], *operands[:n]))

    def partition(mesh, arg_shapes, result_shape):
        axis, args, outs = shardings(mesh, arg_shapes[:n])
        fn = per_shard(mesh, axis)
        replicated = tuple(NamedSharding(mesh, P()) for _ in consts)
        return mesh, lambda *ops: tuple(fn(*with_nones(ops[:n]))), tuple(outs), tuple(args) + replicated

    def infer(mesh, arg_shapes, result_shape):
        return tuple(shardings(mesh, arg_shapes[:n])[2])

    const_rule = "".join(f", {' '.join(f'c{i}_{a}' for a in range(c.ndim))}" for i, c in enumerate(consts))
    rule = ", ".join(in_rules) + const_rule + " -> " + ", ".join(out_rules[kind])
    wrapped = custom_partitioning(impl_with_consts)
    wrapped.def_partition(infer_sharding_from_operands=infer, partition=partition, sharding_rule=rule)
    return lambda *arrays: wrapped(*arrays, *consts)


def _bhsd(rule: str) -> str:
    """A BSHD factor rule of a 4-d array in BHSD order (2-d and 3-d rules are layout-free)."""
    dims = rule.split()
    return " ".join((dims[0], dims[2], dims[1], dims[3])) if len(dims) == 4 else rule


def _role(rule: str) -> str:
    """The role of a factor rule: a 4-d array (``"b s h d"``), segment ids or an lse."""
    dims = rule.split()
    if len(dims) == 4:
        return "b s h d"
    return "b s" if len(dims) == 2 else "b h s"
