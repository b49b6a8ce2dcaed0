"""The contract under ``jax_enable_x64``: every backend that runs on this host gives the float64
reference's outputs and gradients with causal, window, segment ids, GQA and dropout.

Python ints become int64 under x64, so integer index arithmetic that mixes them with int32 program
ids or positions (block ranges, dropout counters) must not depend on the flag. CI also runs the
contract test modules with ``JAX_ENABLE_X64=1`` (``.ci/run``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.contract import registry

# splash_interpret (A/B runs only) takes multiples of 128 alone; the others serve every case here.
BACKENDS = sorted(
    n
    for n, info in registry.all_backends().items()
    if "cpu" in info.platforms and info.available and n != "splash_interpret"
)
# The features a case needs beyond float32/causal/window (cpu_native serves neither; auto falls back).
NEEDS = {"segments_causal_top_left": frozenset({"segment_ids"}), "dropout_causal": frozenset({"dropout"})}
FAST = {("auto", "causal_gqa"), ("auto", "window_sq<sk"), ("pallas_gpu_interpret", "window_sq<sk")}
SEED = 5
CASES = {
    "causal_gqa": dict(causal=True),
    "window_sq<sk": dict(window=(3, 1)),
    "segments_causal_top_left": dict(causal=True, align="top_left", segments=True),
    "dropout_causal": dict(causal=True, dropout_rate=0.25),
}


def _inputs(segments: bool):
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 24, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    ids = {}
    if segments:
        ids = dict(
            q_segment_ids=np.repeat([[0, 1, 2]], 8, axis=1),
            kv_segment_ids=np.repeat([[0, 1, 2, 2]], 10, axis=1),
        )
    return q, k, v, d_out, ids


def _words(seed: int) -> tuple[int, int]:
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


@pytest.mark.parametrize(
    "backend, case",
    [
        pytest.param(b, c, marks=() if (b, c) in FAST else pytest.mark.slow)
        for b in ["auto", *BACKENDS]
        for c in sorted(CASES)
        if b == "auto" or NEEDS.get(c, frozenset()) <= registry.get(b).features
    ],
)
def test_backend_under_x64_matches_reference(backend, case):
    options = dict(CASES[case])
    segments = options.pop("segments", False)
    rate = options.pop("dropout_rate", 0.0)
    if rate and "dropout" not in registry.all_backends().get(backend, registry.get("xla")).features:
        pytest.fail(f"{backend} lacks dropout; NEEDS should leave this case out for it")
    q, k, v, d_out, ids = _inputs(segments)
    ref_kw = dict(options, **ids, dropout_rate=rate, dropout_seed=_words(SEED) if rate else None)
    want, want_lse = reference_attention(q, k, v, **ref_kw)
    want_dq, want_dk, want_dv, _ = reference_attention_vjp(q, k, v, d_out, **ref_kw)
    dropout = dict(dropout_rate=rate, dropout_rng=jax.random.key(SEED)) if rate else {}

    def loss(q, k, v):
        out = flashport.attention(q, k, v, **options, **ids, backend=backend, **dropout)
        return jnp.sum(out * d_out), out

    with jax.enable_x64(True):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        _, lse = flashport.attention(q, k, v, **options, **ids, backend=backend, return_lse=True, **dropout)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, atol=3e-5)
    np.testing.assert_allclose(lse, want_lse, atol=3e-5)
    for got, ref in zip(grads, (want_dq, want_dk, want_dv), strict=True):
        np.testing.assert_allclose(got, ref, atol=3e-4)


@pytest.mark.parametrize("layout", ["BSHD", "BHSD"])
@pytest.mark.parametrize("backend, platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
def test_pallas_kernels_lower_for_their_chip_under_x64(backend, platform, layout):
    """Mosaic and Triton have no 64-bit index types: every loop bound and program-id expression in
    the kernels (GQA head loops, block ranges, dropout counters) must stay int32 under x64."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 128) if layout == "BSHD" else (1, 4, 256, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 128) if layout == "BSHD" else (1, 2, 256, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)

    def loss(q, k, ids):
        out = flashport.attention(
            q,
            k,
            k,
            causal=True,
            window=(64, None),
            q_segment_ids=ids,
            kv_segment_ids=ids,
            dropout_rate=0.1,
            dropout_rng=jax.random.key(0),
            backend=backend,
            layout=layout,
        )
        return out.astype(jnp.float32).sum()

    with jax.enable_x64(True):
        text = (
            jax.jit(jax.grad(loss, argnums=(0, 1)))
            .trace(q, k, seg)
            .lower(lowering_platforms=(platform,))
            .as_text()
        )
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text
