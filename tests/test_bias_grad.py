"""The ``bias_grad`` feature is enforced when JAX differentiates w.r.t. the bias.

A stand-in backend without bias gradients (the ``xla`` backend with the bias behind
``stop_gradient``: its bias gradient is silently zero, as a backend lacking the feature may give)
shows both sides: an explicit ``backend=`` refuses before lowering, and ``auto`` routes the
differentiated call to a backend that has the feature. Gradients are compared with the float64
reference of ``tests/reference.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reduce_to_shape, reference_attention_vjp

import flashport
from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import FEATURES

NAME = "test_no_bias_grad"


@pytest.fixture
def no_bias_grad(monkeypatch):
    """Register the stand-in backend first in auto's CPU preference; undone after the test."""
    xla = registry.get("xla")

    def fn(q, k, v, bias, *rest, spec, options):
        return xla.fn(q, k, v, jax.lax.stop_gradient(bias), *rest, spec=spec, options=options)

    info = dataclasses.replace(xla, name=NAME, features=frozenset(FEATURES) - {"bias_grad"}, fn=fn)
    monkeypatch.setitem(registry._REGISTRY, NAME, info)
    monkeypatch.setitem(registry.AUTO_PREFERENCE, "cpu", (NAME, "blockwise", "xla"))
    jax.clear_caches()  # jitted dispatch traced under the default preference must not be reused
    yield NAME
    jax.clear_caches()


def _inputs():
    r = np.random.default_rng(14)
    q, k, v = (r.standard_normal((1, s, 2, 8)).astype(np.float32) for s in (5, 7, 7))
    bias = r.standard_normal((1, 2, 5, 7)).astype(np.float32)
    d_out = r.standard_normal((1, 5, 2, 8)).astype(np.float32)
    return q, k, v, bias, d_out


def _loss(backend):
    def loss(q, k, v, bias, d_out):
        out = flashport.attention(q, k, v, bias=bias, causal=True, backend=backend)
        return (out * d_out).sum()

    return loss


def _reference(q, k, v, bias, d_out):
    dq, dk, dv, dbias = reference_attention_vjp(q, k, v, d_out, bias=bias, causal=True)
    return dq, dk, dv, reduce_to_shape(dbias, bias.shape)


def test_explicit_backend_refuses_a_differentiated_bias(no_bias_grad):
    q, k, v, bias, d_out = _inputs()
    for transform in (jax.grad, lambda f, argnums: jax.jit(jax.grad(f, argnums=argnums))):
        with pytest.raises(
            ValueError, match=r"backend='test_no_bias_grad' does not give gradients w\.r\.t\. bias"
        ):
            transform(_loss(no_bias_grad), argnums=3)(q, k, v, bias, d_out)


def test_explicit_backend_serves_other_gradients(no_bias_grad):
    q, k, v, bias, d_out = _inputs()
    got = jax.grad(_loss(no_bias_grad), argnums=(0, 1, 2))(q, k, v, bias, d_out)
    for g, want in zip(got, _reference(q, k, v, bias, d_out)[:3], strict=True):
        np.testing.assert_allclose(g, want, rtol=2e-5, atol=2e-5)
    out = flashport.attention(q, k, v, bias=bias, causal=True, backend=no_bias_grad)
    assert out.shape == q.shape  # the forward alone is fine


@pytest.mark.parametrize("jit_outside", [False, True])
def test_auto_routes_a_differentiated_bias_to_a_backend_with_bias_gradients(no_bias_grad, jit_outside):
    q, k, v, bias, d_out = _inputs()
    grad = jax.grad(_loss("auto"), argnums=(0, 1, 2, 3))
    got = (jax.jit(grad) if jit_outside else jax.grad(jax.jit(_loss("auto")), argnums=(0, 1, 2, 3)))(
        q, k, v, bias, d_out
    )
    want = _reference(q, k, v, bias, d_out)
    assert float(jnp.abs(want[3]).max()) > 0.1  # the stand-in's zero bias gradient would fail below
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_attention_backward_never_picks_a_backend_without_bias_gradients(no_bias_grad):
    q, k, v, bias, d_out = _inputs()
    out, lse = flashport.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    with pytest.raises(ValueError, match="bias_grad"):
        flashport.attention_backward(q, k, v, out, lse, d_out, bias=bias, causal=True, backend=no_bias_grad)
    got = flashport.attention_backward(q, k, v, out, lse, d_out, bias=bias, causal=True)
    for g, w in zip(got, _reference(q, k, v, bias, d_out), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
