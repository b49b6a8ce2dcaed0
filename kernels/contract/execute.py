"""Run one backend on the canonical arrays: the forward, the residual backward (or its recomputing
fallback), and the check that an explicitly named backend can serve a call.

The lowest layer of dispatch: :mod:`flashport.kernels.contract.deferred` lowers through it, and
:mod:`flashport.kernels.contract.dispatch` and the ring (:mod:`flashport.kernels.parallel`) call it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax

from flashport.kernels.contract import registry
from flashport.kernels.contract.call import Call
from flashport.kernels.semantics.mods import Mods

log = logging.getLogger("flashport")


def run(
    choice: registry.BackendChoice, call: Call, args: tuple[jax.Array | None, ...], mods: Mods | None = None
) -> tuple[jax.Array, jax.Array]:
    info = registry.get(choice.name)
    log.debug("flashport_attention %s: running backend %s", describe(call), info.name)
    # The spec's hints (kernels/contract/spec.py): the caller's layout, and whether it keeps the lse.
    spec = dataclasses.replace(call.spec, layout=call.layout, lse_used="return_lse" in call.features)
    if mods is not None:  # only backends that declare the mod features get (and take) mods=
        return info.fn(*args, spec=spec, options=choice.options_dict, mods=mods)
    return info.fn(*args, spec=spec, options=choice.options_dict)


def run_positional(
    choice: registry.BackendChoice, call: Call, *args: jax.Array | None, mods: Mods | None = None
) -> tuple[jax.Array, jax.Array]:
    return run(choice, call, args, mods)


def describe(call: Call) -> str:
    return f"q{list(call.q_shape)} kv{list(call.kv_shape)} {call.dtype} features={sorted(call.features)}"


def resolve_backend(backend: object, call: Call) -> registry.BackendChoice | None:
    """Return None for auto, else a BackendChoice that is known to support ``call``."""
    if isinstance(backend, str):
        if backend == "auto":
            return None
        choice = registry.BackendChoice(backend)
    elif isinstance(backend, registry.BackendChoice):
        choice = backend
    else:
        raise TypeError(
            f"backend must be 'auto', a backend name or flashport.kernels.contract.registry.use(name, **options); "
            f"got {type(backend).__name__}"
        )
    info = registry.get(choice.name)
    missing = registry.missing_features(info, call)
    if missing:
        alternatives = registry.backends_with(call.features) or ["none"]
        raise ValueError(
            f"backend={choice.name!r} does not support this call: {'; '.join(missing)}; "
            f"backends that support these features: {', '.join(alternatives)} (or use backend='auto')"
        )
    return choice


def run_backend(choice, call, args, mods=None):
    """``(dq, dk, dv, dbias)`` of backend ``choice`` from the canonical forward args, ``out``, ``lse``
    and the cotangents: its residual backward, or the recomputing fallback. ``mods``: the forward's
    score_mod / mask_mod, or None."""
    info = registry.get(choice.name)
    options = choice.options_dict
    extra = {} if mods is None else {"mods": mods}  # only backends with the mod features get mods
    if info.backward is not None:
        return tuple(info.backward(*args, spec=call.spec, options=options, **extra))
    log.debug(
        "flashport_attention_backward: backend %s has no residual backward; recomputing its "
        "forward under jax.vjp",
        info.name,
    )
    fn = functools.partial(info.fn, **extra)
    return recompute_backward(fn, *args, spec=call.spec, options=options)


def run_backend_positional(choice, call, *args, mods=None):
    return run_backend(choice, call, args, mods)


def recompute_backward(
    fn, q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, d_out, d_lse, *, spec, options
):
    """The fallback for backends without a residual backward: ``jax.vjp`` of the backend's forward
    ``fn`` (``out`` and ``lse`` are ignored; the forward runs again)."""

    def forward(q, k, v, bias):
        return fn(q, k, v, bias, mask, q_seg, kv_seg, seed, spec=spec, options=options)

    _, vjp = jax.vjp(forward, q, k, v, bias)
    return tuple(vjp((d_out.astype(q.dtype), d_lse)))
