"""The ``backend="auto"`` branches for platforms this process does not run on, traced only if lowered.

``auto`` stages one branch per platform (``lax.platform_dependent``), because the platform a program
runs on is known only when it is lowered: ahead-of-time lowering (``lowering_platforms=("tpu",)``,
``jax.export``) may target a chip this host lacks. Tracing every branch (and differentiating each
under ``grad``) costs several times the chosen kernel's own trace. So the branch of this process's
platform (:func:`host_platform`) is traced as usual, and every other one is a single
:data:`deferred_p` equation that names its backend and call: it is traced and lowered only when a
module is lowered for that platform, and otherwise costs nothing.

A call's ``score_mod`` / ``mask_mod`` (:class:`~flashport.kernels.semantics.mods.Mods`) cross the equation
as its arrays (operands after the canonical ones, the floating ones differentiable) and its pytree
structure (a static parameter holding the traced mods).

Transformations keep it deferred: its JVP is the deferred forward plus a deferred linear tangent
equation whose transpose is the backend's residual backward
(:func:`flashport.kernels.contract.execute.run_backend`, from ``out`` and ``lse``), and ``vmap`` records the
batch axes the lowering maps over. Forward-mode autodiff of a deferred branch lowers
``jax.jvp`` of the backend, which backends with a ``custom_vjp`` refuse, as they do when traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import ad, batching, mlir

from flashport.kernels.contract import execute

deferred_p = core.Primitive("flashport_deferred_backend")
deferred_p.multiple_results = True

# Canonical arrays (kernels/contract/call.py): q, k, v, bias, mask, q_segment_ids, kv_segment_ids, seed.
N_CANONICAL = 8


def host_platform() -> str:
    """The platform programs of this process lower for unless told otherwise (``cpu``, ``cuda``, ...)."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = jax.devices()[0].client.platform_version.lower()
    return "rocm" if "rocm" in version else "cuda"


def _mod_leaves(mods) -> tuple[list, Any, tuple[int, ...]]:
    """``(leaves, treedef, float positions)`` of a :class:`~flashport.kernels.semantics.mods.Mods` (or None):
    its arrays travel as operands after the canonical ones; the floating ones are differentiable."""
    if mods is None:
        return [], None, ()
    leaves, tree = jax.tree_util.tree_flatten(mods)
    floats = tuple(n for n, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.floating))
    return leaves, tree, floats


def run(choice, call, *args: jax.Array | None, mods=None) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of backend ``choice`` on the canonical ``args`` (and the call's ``mods``, or
    None), traced when lowered."""
    present = tuple(a is not None for a in args)
    b, hq, sq, _ = call.q_shape
    avals = (
        core.ShapedArray((b, hq, sq, call.v_head_dim), jnp.dtype(call.dtype)),
        core.ShapedArray((b, hq, sq), jnp.float32),
    )
    operands = [a for a in args if a is not None]
    leaves, tree, floats = _mod_leaves(mods)
    diff = (*range(_n_diff(present)), *(len(operands) + n for n in floats))
    params = dict(choice=choice, call=call, present=present, mods_tree=tree, diff=diff)
    return tuple(deferred_p.bind(*operands, *leaves, mode="forward", levels=(), out_avals=avals, **params))


def run_backward(choice, call, *args: jax.Array | None, mods=None) -> tuple[jax.Array | None, ...]:
    """``(dq, dk, dv, dbias)`` of backend ``choice``'s residual backward, traced when lowered.

    ``args``: the canonical arrays, then ``out``, ``lse``, ``d_out``, ``d_lse``
    (:func:`flashport.kernels.contract.execute.run_backend`); ``mods``: the forward's, or None.
    """
    canonical, residuals = args[:N_CANONICAL], args[N_CANONICAL:]
    present = tuple(a is not None for a in canonical)
    operands = [a for a in canonical if a is not None]
    leaves, tree, _ = _mod_leaves(mods)
    diff = tuple(range(_n_diff(present)))
    grads = deferred_p.bind(
        *operands,
        *leaves,
        *residuals,
        mode="backward",
        choice=choice,
        call=call,
        present=present,
        mods_tree=tree,
        diff=diff,
        levels=(),
        out_avals=tuple(core.ShapedArray(operands[n].shape, operands[n].dtype) for n in diff),
    )
    return (*grads[:3], grads[3] if present[3] else None)


def _n_diff(present: tuple[bool, ...]) -> int:
    """How many leading operands are differentiable: q, k, v and the bias when present."""
    return 3 + int(present[3])


def _full(present, operands) -> list[Any]:
    """The canonical argument list (None where absent) from the present operands."""
    it = iter(operands)
    return [next(it) if p else None for p in present]


def _n_primals(present, mods_tree) -> int:
    """Operands before the residuals: the present canonical arrays and the mods' arrays."""
    return sum(present) + (0 if mods_tree is None else mods_tree.num_leaves)


def _base(mode: str, choice, call, present, mods_tree, diff) -> Callable[..., tuple]:
    """The unbatched function an equation of ``mode`` lowers to. Operands: the present canonical
    arrays, the mods' arrays, then (tangent) ``out``, ``lse`` and the tangents of the ``diff``
    operands, or (backward) ``out``, ``lse``, ``d_out``, ``d_lse``; the backward returns the
    cotangents of the ``diff`` operands."""
    from flashport.kernels.backends.blockwise import mods_cotangent

    n_c, n = sum(present), _n_primals(present, mods_tree)

    def split(primals):
        canonical = tuple(_full(present, primals[:n_c]))
        mods = None if mods_tree is None else jax.tree_util.tree_unflatten(mods_tree, primals[n_c:n])
        return canonical, mods

    def forward(*operands):
        canonical, mods = split(operands)
        return tuple(execute.run(choice, call, canonical, mods))

    if mode == "forward":
        return forward
    if mode == "tangent":  # operands: primals, out, lse, tangents of the differentiable primals

        def tangent(*operands):
            primals, tangents = operands[:n], operands[n + 2 :]

            def of_diff(*chosen):
                full = list(primals)
                for i, x in zip(diff, chosen, strict=True):
                    full[i] = x
                return forward(*full)

            return tuple(jax.jvp(of_diff, tuple(primals[i] for i in diff), tuple(tangents))[1])

        return tangent

    def backward_fn(*operands):  # operands: primals, out, lse, d_out, d_lse
        primals, (out, lse, d_out, d_lse) = operands[:n], operands[n:]
        canonical, mods = split(primals)
        residuals = (out, lse, d_out.astype(out.dtype), d_lse)
        grads = execute.run_backend(choice, call, (*canonical, *residuals), mods)
        by_index = {i: g for i, g in zip(range(_n_diff(present)), grads, strict=False)}
        if any(i >= n_c for i in diff):  # the score_mod's arrays (the mask_mod's have none)
            d_mods = mods_cotangent(*canonical, *residuals, spec=call.spec, mods=mods)
            for m, g in enumerate(d_mods.score_consts):
                by_index[n_c + m] = g
        return tuple(
            jnp.zeros_like(primals[i]) if by_index.get(i) is None else by_index[i].astype(primals[i].dtype)
            for i in diff
        )

    return backward_fn


def _lowered(mode, choice, call, present, mods_tree, diff, levels) -> Callable[..., tuple]:
    fn = _base(mode, choice, call, present, mods_tree, diff)
    for in_axes, place in levels:
        fn = _vmapped(fn, in_axes, place)
    return fn


def _vmapped(fn, in_axes, place):
    mapped = jax.vmap(fn, in_axes=in_axes, out_axes=0)
    if place is None:
        return mapped

    def placed(*xs):  # cotangents go where their primal's batch axis is (summed if it has none)
        outs = mapped(*xs)
        return tuple(
            o.sum(0) if a is None else jnp.moveaxis(o, 0, a) for o, a in zip(outs, place, strict=True)
        )

    return placed


@deferred_p.def_abstract_eval
def _abstract_eval(*operands, out_avals, **params):
    return list(out_avals)


def _impl(*operands, **params):
    return jax.jit(lambda *a: deferred_p.bind(*a, **params))(*operands)


deferred_p.def_impl(_impl)


def _lowering(ctx, *operands, mode, choice, call, present, mods_tree, diff, levels, out_avals):
    fn = _lowered(mode, choice, call, present, mods_tree, diff, levels)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


mlir.register_lowering(deferred_p, _lowering)


def _jvp(primals, tangents, *, mode, choice, call, present, mods_tree, diff, levels, out_avals):
    if mode != "forward":
        raise NotImplementedError("flashport: a deferred auto branch is differentiable once")
    params = dict(choice=choice, call=call, present=present, mods_tree=mods_tree, diff=diff)
    outs = deferred_p.bind(*primals, mode="forward", levels=levels, out_avals=out_avals, **params)
    if all(type(tangents[i]) is ad.Zero for i in diff):
        return outs, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
    chosen = [ad.instantiate_zeros(tangents[i]) for i in diff]
    tangent_levels = tuple(((*axes, 0, 0, *(axes[i] for i in diff)), None) for axes, _ in levels)
    t_out = deferred_p.bind(
        *primals, *outs, *chosen, mode="tangent", levels=tangent_levels, out_avals=out_avals, **params
    )
    return outs, t_out


ad.primitive_jvps[deferred_p] = _jvp


def _transpose(cts, *operands, mode, choice, call, present, mods_tree, diff, levels, out_avals):
    if mode != "tangent":
        raise NotImplementedError(f"flashport: a deferred {mode} equation is not linear")
    n = _n_primals(present, mods_tree)
    primals, (out, lse), tangents = operands[:n], operands[n : n + 2], operands[n + 2 :]
    d_out, d_lse = (ad.instantiate_zeros(c) if type(c) is ad.Zero else c for c in cts)
    backward_levels = tuple(((*axes[: n + 2], 0, 0), axes[n + 2 :]) for axes, _ in levels)
    grads = deferred_p.bind(
        *primals,
        out,
        lse,
        d_out,
        d_lse,
        mode="backward",
        choice=choice,
        call=call,
        present=present,
        mods_tree=mods_tree,
        diff=diff,
        levels=backward_levels,
        out_avals=tuple(t.aval for t in tangents),
    )
    return [None] * (n + 2) + list(grads)


ad.primitive_transposes[deferred_p] = _transpose


def _batch(operands, dims, *, out_avals, levels, **params):
    axes = tuple(dims)  # None where an operand is not batched
    size = next(x.shape[d] for x, d in zip(operands, axes, strict=True) if d is not None)
    avals = tuple(core.ShapedArray((size, *a.shape), a.dtype) for a in out_avals)
    outs = deferred_p.bind(*operands, levels=(*levels, (axes, None)), out_avals=avals, **params)
    return outs, [0] * len(outs)


batching.primitive_batchers[deferred_p] = _batch
