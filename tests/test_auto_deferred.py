"""``backend="auto"`` traces only the branch of this process's platform; the other platforms'
branches are deferred (``kernels/contract/deferred.py``) and traced only when a module is lowered for them.

The deferred branches are exercised on this CPU host by pretending the process runs elsewhere
(``deferred.host_platform`` patched), so the CPU branch is the deferred one and its forward, its
gradients (the residual backward, bias included), ``vmap`` in both orders with ``grad``, ``jit``
and ``jax.checkpoint`` are compared with the float64 reference. Lowering for a TPU from this host
still holds the TPU kernel, and a debug log of one call names the backend that runs once.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from reference import reference_attention, reference_attention_vjp, reference_mod_vjp

import flashport
from flashport.kernels.contract import deferred

OPTIONS = dict(causal=True, softcap=3.0)


def _inputs():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 24, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 32, 2, 16)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((1, 4, 24, 32)).astype(np.float32)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    return q, k, v, bias, d_out


def _eqn_names(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            names.extend(_eqn_names(sub))
    return names


@pytest.fixture(autouse=True)
def fresh_traces():
    """The host platform is read when ``flashport_attention`` is traced; its jit cache would keep
    a trace made under another (patched) platform."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.fixture(params=["tpu", "elsewhere"])
def cpu_branch_deferred(request, monkeypatch):
    """This process 'runs' on a TPU (the TPU branch is traced) or on no known platform (all deferred)."""
    monkeypatch.setattr(deferred, "host_platform", lambda: request.param)
    return request.param


def test_deferred_branch_forward_and_gradients_match_reference(cpu_branch_deferred):
    q, k, v, bias, d_out = _inputs()
    want, _ = reference_attention(q, k, v, bias=bias, **OPTIONS)
    wants = reference_attention_vjp(q, k, v, d_out, bias=bias, **OPTIONS)

    def loss(q, k, v, bias):
        out = flashport.attention(q, k, v, bias=bias, **OPTIONS)
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
    np.testing.assert_allclose(out, want, atol=3e-5)
    for got, ref in zip(grads, (*wants[:3], wants[3].sum(axis=0, keepdims=True)), strict=True):
        np.testing.assert_allclose(got, ref, atol=3e-4)
    remat = jax.grad(jax.checkpoint(lambda q: loss(q, k, v, bias)[0]))(q)
    np.testing.assert_allclose(remat, wants[0], atol=3e-4)


def test_deferred_branch_under_vmap_and_grad(monkeypatch):
    monkeypatch.setattr(deferred, "host_platform", lambda: "elsewhere")
    q, k, v, _, d_out = _inputs()
    qb = np.stack([q, 0.5 * q])

    def loss(q, k):
        return jnp.sum(flashport.attention(q, k, v, **OPTIONS) * d_out)

    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(qb, k)
    of_batch = jax.grad(lambda qb, k: jax.vmap(loss, in_axes=(0, None))(qb, k).sum(), argnums=(0, 1))(qb, k)
    dk_total = 0.0
    for i, qi in enumerate(qb):
        dq, dk, _, _ = reference_attention_vjp(qi, k, v, d_out, **OPTIONS)
        np.testing.assert_allclose(per_example[0][i], dq, atol=3e-4)
        np.testing.assert_allclose(per_example[1][i], dk, atol=3e-4)
        np.testing.assert_allclose(of_batch[0][i], dq, atol=3e-4)
        dk_total = dk_total + dk
    np.testing.assert_allclose(of_batch[1], dk_total, atol=5e-4)


def test_deferred_branch_runs_mods(cpu_branch_deferred):
    """score_mod / mask_mod cross the deferred equation: forward, lse and the gradients of q, k, v
    and of the array the score_mod closes over (ALiBi slopes) match the float64 reference."""
    q, k, v, _, d_out = _inputs()
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    docs = np.array([0] * 14 + [1] * 18, np.int32)
    ids = jnp.asarray(docs)
    ref_mods = dict(
        score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i),
        mask_mod=lambda b, h, i, j: docs[i + 8] == docs[j],
    )
    want_out, _ = reference_attention(q, k, v, **ref_mods, **OPTIONS)
    *want, _, d_scores = reference_mod_vjp(q, k, v, d_out, **ref_mods, **OPTIONS)

    def loss(q, k, v, sl):
        out = flashport.attention(
            q,
            k,
            v,
            score_mod=lambda s, b, h, i, j: s + sl[h] * (j - i),
            mask_mod=lambda b, h, i, j: ids[i + 8] == ids[j],
            **OPTIONS,
        )
        return jnp.sum(out * d_out), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = step(q, k, v, jnp.asarray(slopes))
    np.testing.assert_allclose(out, want_out, atol=3e-5)
    for got, ref in zip(grads[:3], want[:3], strict=True):
        np.testing.assert_allclose(got, ref, atol=3e-4)
    d_slopes = np.einsum("bhij,ij->h", d_scores, np.arange(32)[None, :] - np.arange(24)[:, None])
    np.testing.assert_allclose(grads[3], d_slopes, atol=3e-4, rtol=1e-4)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: loss(q, k, v, jnp.asarray(slopes))[0]))(q)
    assert "flashport_deferred_backend" in _eqn_names(jaxpr.jaxpr)


def test_only_this_platforms_branch_is_traced():
    """On this CPU host the gradient's jaxpr holds no Pallas kernel: the TPU and CUDA branches are
    single deferred equations (forward, tangent), not traced kernels."""
    q, k, v, bias, _ = _inputs()
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: flashport.attention(q, k, v, bias=bias, **OPTIONS).sum()))(q)
    names = _eqn_names(jaxpr.jaxpr)
    assert "pallas_call" not in names and "flashport_tpu_only" not in names
    assert "flashport_deferred_backend" in names
    # with a score_mod and a mask_mod too: the TPU and CUDA kernels are not traced here
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])

    def with_mods(q, slopes):
        out = flashport.attention(
            q,
            k,
            v,
            score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i),
            mask_mod=lambda b, h, i, j: j <= i,
        )
        return out.sum()

    names = _eqn_names(jax.make_jaxpr(jax.grad(with_mods, argnums=(0, 1)))(q, slopes).jaxpr)
    assert "pallas_call" not in names and "flashport_tpu_only" not in names
    assert "flashport_deferred_backend" in names


def test_lowering_for_tpu_from_this_host_holds_the_tpu_kernels():
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda q: flashport.attention(q, q, q, causal=True).astype(jnp.float32).sum()))
    text = grad.trace(q).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dK/dV and dQ kernels


def test_debug_log_names_the_running_backend_once(caplog):
    q, k, v, bias, _ = _inputs()
    with caplog.at_level(logging.DEBUG, logger="flashport"):
        flashport.attention(q, k, v, bias=bias, causal=True, window=(3, 2))
    running = [r.getMessage() for r in caplog.records if "running backend" in r.getMessage()]
    assert len(running) == 1, running
