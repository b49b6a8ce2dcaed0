"""An explicit backend runs natively or not at all: a Pallas backend asked for on a platform it
cannot run on raises (naming the platform and its interpret twin) instead of silently running
the Pallas interpreter; lowering ahead of time for its own platform still works from any host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import flashport

NATIVE = {"pallas_tpu": "tpu", "pallas_gpu": "cuda"}


def _platform() -> str:
    return jax.devices()[0].platform


@pytest.mark.parametrize("backend", sorted(NATIVE))
def test_explicit_backend_off_its_platform_raises(backend):
    if _platform() in (NATIVE[backend], "gpu"):
        pytest.fail("this test needs a host without the backend's platform; CI's hosts are CPU-only")
    q = jnp.ones((1, 32, 2, 16), jnp.float32)
    with pytest.raises(ValueError) as err:
        flashport.attention(q, q, q, causal=True, backend=backend)
    message = str(err.value)
    assert f"{backend}_interpret" in message and _platform() in message and NATIVE[backend] in message, (
        message
    )
    with pytest.raises(ValueError, match=f"{backend}_interpret"):
        jax.jit(lambda q: flashport.attention(q, q, q, backend=backend))(q)


@pytest.mark.parametrize("backend", sorted(NATIVE))
def test_explicit_backend_lowers_ahead_of_time_for_its_platform(backend):
    q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.bfloat16)
    f = jax.jit(
        jax.grad(lambda q: flashport.attention(q, q, q, causal=True, backend=backend).sum().astype(float))
    )
    text = f.trace(q).lower(lowering_platforms=(NATIVE[backend],)).as_text()
    assert ("tpu_custom_call" if backend == "pallas_tpu" else "__gpu$xla.gpu.triton") in text


@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_interpret_twins_still_run_here(backend):
    q = jnp.asarray(jax.random.normal(jax.random.key(0), (1, 32, 2, 16)), jnp.float32)
    got = flashport.attention(q, q, q, causal=True, backend=backend)
    want = flashport.attention(q, q, q, causal=True, backend="xla")
    assert jnp.max(jnp.abs(got - want)) < 1e-5
