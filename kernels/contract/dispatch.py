"""The jitted ops ``flashport_attention`` and ``flashport_attention_backward`` on canonical arrays.

An explicit backend runs as is; ``backend="auto"`` is one ``lax.platform_dependent`` branch per
platform, the branches of other platforms deferred until lowering
(:mod:`flashport.kernels.contract.deferred`). A bias whose gradient JAX asks for narrows the choice to
backends with bias gradients (:mod:`flashport.kernels.semantics.bias_grad`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

from flashport.kernels.contract import deferred, execute, registry
from flashport.kernels.contract.call import PLATFORMS, Call
from flashport.kernels.semantics import bias_grad
from flashport.kernels.semantics.mods import Mods

log = logging.getLogger("flashport")


@functools.partial(jax.jit, static_argnames=("call", "choice"))
def flashport_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    mods: Mods | None = None,
    *,
    call: Call,
    choice: registry.BackendChoice | None,
) -> tuple[jax.Array, jax.Array]:
    """The jitted op (its name is what jaxprs, profiles and cost analyses show). Canonical in/out."""
    args = (q, k, v, bias, mask, q_seg, kv_seg, seed)
    with jax.named_scope("flashport_attention"):
        if call.kv_shape[2] == 0:
            return _no_keys(call)
        run = functools.partial(_dispatch, call, choice, mods)
        if bias is None or mods is not None:  # with mods, only backends with bias gradients qualify
            return run(*args)
        # Whether the bias is differentiated shows only when JAX differentiates (kernels/semantics/bias_grad.py).
        if choice is not None and bias_grad.FEATURE not in registry.get(choice.name).features:
            return bias_grad.guarded(run, None, _bias_grad_refusal(choice.name, call), *args)
        with_grad = dataclasses.replace(call, features=call.features | {bias_grad.FEATURE})
        if choice is None and _names(_auto_picks(call)) != _names(_auto_picks(with_grad)):
            return bias_grad.guarded(run, functools.partial(_dispatch, with_grad, None, None), "", *args)
        return run(*args)


def _dispatch(
    call: Call, choice: registry.BackendChoice | None, mods: Mods | None, *args: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Run an explicit backend, or the one ``auto`` picks per platform (chosen when lowering)."""
    if choice is not None:
        return execute.run(choice, call, args, mods)
    picks = _auto_picks(call)
    log.debug(
        "flashport_attention %s: auto picks %s",
        execute.describe(call),
        "; ".join(f"{p}->{name} ({why})" for p, (name, why) in picks.items()),
    )
    return _per_platform(picks, call, args, mods, execute.run, execute.run_positional, deferred.run)


def _per_platform(picks, call: Call, args: tuple, mods: Mods | None, run, run_positional, later):
    """Run the backend ``picks`` names on every platform with ``run(choice, call, args, mods)``, or,
    where platforms pick differently, branch with ``lax.platform_dependent``
    (:func:`platform_branches` with ``run_positional``, deferring the others with ``later``)."""
    names = {name for name, _ in picks.values()}
    if len(names) == 1:
        return run(registry.BackendChoice(names.pop()), call, args, mods)
    branches = platform_branches(
        picks, call, functools.partial(run_positional, mods=mods), functools.partial(later, mods=mods)
    )
    return jax.lax.platform_dependent(*args, **branches)


def platform_branches(
    picks: dict[str, tuple[str, str]], call: Call, traced: Any, later: Any = None
) -> dict[str, Any]:
    """``platform_dependent`` branches for per-platform ``picks``: ``traced(choice, call, *args)`` for
    the backend picked on this process's platform (and for backends that cannot be deferred),
    ``later(choice, call, *args)`` (traced only if a module is lowered for that platform,
    :mod:`flashport.kernels.contract.deferred`) for the others, or ``traced`` for every one when ``later`` is
    None; one branch per backend, with ``cpu``'s as the default."""
    here = picks.get(deferred.host_platform(), (None, ""))[0]
    by_name = {
        name: functools.partial(
            traced if later is None or name == here or not registry.get(name).deferrable else later,
            registry.BackendChoice(name),
            call,
        )
        for name, _ in picks.values()
    }
    branches = {p: by_name[name] for p, (name, _) in picks.items()}
    return dict(branches, default=branches["cpu"])


def _auto_picks(call: Call) -> dict[str, tuple[str, str]]:
    """``auto``'s ``(backend, why)`` on every platform for ``call``."""
    return {p: registry.choose(p, call) for p in PLATFORMS}


def _names(picks: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {platform: name for platform, (name, _) in picks.items()}


def _bias_grad_refusal(name: str, call: Call) -> str:
    """The error for a differentiated bias on an explicit backend without bias gradients."""
    features = call.features | {bias_grad.FEATURE}
    alternatives = registry.backends_with(features) or ["none"]
    return (
        f"backend={name!r} does not give gradients w.r.t. bias (feature {bias_grad.FEATURE!r}), and this "
        f"call differentiates its bias; backends that support these features: {', '.join(alternatives)} "
        f"(or use backend='auto', or jax.lax.stop_gradient the bias)"
    )


def _no_keys(call: Call) -> tuple[jax.Array, jax.Array]:
    """The contract for Sk == 0, on every backend: every query row sees no key, so out is 0 and lse
    is -inf (their gradients are 0). Kernels need not handle empty key blocks."""
    b, hq, sq, _ = call.q_shape
    return jnp.zeros((b, hq, sq, call.v_head_dim), jnp.dtype(call.dtype)), jnp.full(
        (b, hq, sq), -jnp.inf, jnp.float32
    )


@functools.partial(jax.jit, static_argnames=("call", "choice"))
def flashport_attention_backward(
    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse, mods=None, *, call: Call, choice
):
    """The jitted backward on canonical arrays; returns canonical ``(dq, dk, dv, dbias)``. ``mods``:
    the forward's score_mod / mask_mod (:mod:`flashport.kernels.semantics.mods`), or None."""
    args = (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse)
    with jax.named_scope("flashport_attention_backward"):
        if call.kv_shape[2] == 0:  # no keys: out = 0, lse = -inf, every gradient is 0
            zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
            return (*zeros, None if bias is None else jnp.zeros_like(bias))
        if choice is not None:
            return execute.run_backend(choice, call, args, mods)
        runners = (execute.run_backend, execute.run_backend_positional, deferred.run_backward)
        return _per_platform(_auto_picks(call), call, args, mods, *runners)
