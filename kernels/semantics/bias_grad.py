"""The ``bias_grad`` feature: a differentiated bias only reaches backends that give its gradient.

Whether a call needs the gradient w.r.t. its bias is not visible when the call is made: JAX decides
it when it differentiates the traced computation. So a call with a bias whose backend lacks
``bias_grad`` (an explicit one, or the one ``auto`` picks on some platform) runs under a
``jax.custom_vjp`` whose forward rule sees which inputs are perturbed (``symbolic_zeros=True``):

* bias not differentiated: the same backend runs, and its own VJP gives the other gradients;
* bias differentiated, explicit backend: ``ValueError`` naming the feature and the backends that
  have it, raised while JAX traces the derivative, before anything is lowered;
* bias differentiated, ``auto``: the call is dispatched again with ``bias_grad`` among its features,
  so every platform's pick is a backend that has it.

Calls without a bias, or whose backends all have ``bias_grad``, never pass through here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

FEATURE = "bias_grad"

# (q, k, v, bias, mask, q_segment_ids, kv_segment_ids, seed) -> (out, lse), on canonical arrays.
Runner = Callable[..., tuple[jax.Array, jax.Array]]


def guarded(run: Runner, run_with_bias_grad: Runner | None, refusal: str, *args: jax.Array | None):
    """``run(*args)``, except where JAX differentiates w.r.t. the bias (``args[3]``).

    Args:
      run: the dispatch for the call as made.
      run_with_bias_grad: the dispatch to differentiate when the bias is perturbed (``auto``
        re-dispatched with ``bias_grad``), or None to refuse with ``ValueError(refusal)``.
      refusal: the error message for an explicit backend without bias gradients.
      args: the canonical arrays (the bias is not None).

    Returns:
      ``(out, lse)`` of ``run``, differentiable w.r.t. query, key, value and bias.
    """

    @jax.custom_vjp
    def attend(*arrays: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return run(*arrays)

    def forward(*primals: CustomVJPPrimal | None) -> tuple[tuple[jax.Array, jax.Array], Callable]:
        bias = primals[3]
        perturbed = bias is not None and bias.perturbed
        if perturbed and run_with_bias_grad is None:
            raise ValueError(refusal)
        chosen = run_with_bias_grad if perturbed and run_with_bias_grad is not None else run
        values = [None if p is None else p.value for p in primals]
        rest = values[4:]  # mask, segment ids, seed: not differentiable

        def differentiable(q: jax.Array, k: jax.Array, v: jax.Array, b: jax.Array):
            return chosen(q, k, v, b, *rest)

        outputs, vjp = jax.vjp(differentiable, *values[:4])
        return outputs, vjp  # the pullback is a pytree of arrays (jax.tree_util.Partial)

    def backward(vjp: Callable, cotangents: tuple) -> tuple:
        d_out, d_lse = (jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c for c in cotangents)
        return (*vjp((d_out, d_lse)), None, None, None, None)

    attend.defvjp(forward, backward, symbolic_zeros=True)
    return attend(*args)
