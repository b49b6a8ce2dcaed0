"""What matmul precision a caller gets: float32 math for float32 inputs unless they choose otherwise.

On CUDA, XLA runs float32 matmuls in TF32 by default (~1e-3 error); the contract promises float32,
so the XLA backends ask for ``Precision.HIGHEST`` on float32 operands, and honour
``jax.default_matmul_precision`` when the caller sets it. Checked on the traced program (the
precision is a parameter of every ``dot_general``), which is what every platform compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import flashport


def _dot_precisions(fn, *args):
    """The ``precision`` param of every dot_general in ``fn``'s jaxpr, nested jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else _subjaxprs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr
            elif hasattr(item, "eqns"):
                yield item


def _train(backend, dtype):
    q = jnp.ones((1, 64, 2, 16), dtype)

    def loss(q):
        return jnp.sum(flashport.attention(q, q, q, causal=True, backend=backend).astype(jnp.float32))

    return jax.grad(loss), q


HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_float32_inputs_get_float32_matmuls_forward_and_backward(backend):
    precisions = _dot_precisions(*_train(backend, jnp.float32))
    assert len(precisions) >= 4  # forward QK, PV and backward products
    assert all(p == HIGHEST for p in precisions), precisions


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_bfloat16_inputs_keep_the_platform_default(backend):
    precisions = _dot_precisions(*_train(backend, jnp.bfloat16))
    assert precisions and all(p is None for p in precisions), precisions


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_a_chosen_default_matmul_precision_is_honoured(backend):
    fn, q = _train(backend, jnp.float32)
    x = jnp.ones((4, 4), jnp.float32)
    with jax.default_matmul_precision("tensorfloat32"):
        precisions = _dot_precisions(fn, q)
        plain = _dot_precisions(lambda x: x @ x, x)  # what any float32 matmul gets under the choice
    assert plain != [HIGHEST]
    assert precisions and all(p == plain[0] for p in precisions), (precisions, plain)
    # ... and the choice does not stick: the next call without it is float32 again.
    assert all(p == HIGHEST for p in _dot_precisions(fn, q))
