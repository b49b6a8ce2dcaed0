"""The ``cpu_native`` backend (kernels/backends/cpu_native): its C++ FlashAttention-2 kernel against the
float64 reference, its build cache and its fallback when it cannot be built.

The kernel must build here (CI has a C++ compiler), and ``auto`` must pick it on CPU for the
benchmark's config; nothing skips.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.backends.cpu_native import backend as native
from flashport.kernels.backends.cpu_native import build
from flashport.kernels.contract import api, registry

# Small tiles, so that the cases below span several ragged query and key blocks on two threads.
# Like the browser test's chromium, the compiler is a system package: CI installs it (.ci/run), a
# machine without one runs flashport's CPU path on blockwise, which the rest of the suite covers.
NEEDS_COMPILER = pytest.mark.skipif(
    build.compiler() is None,
    reason="no C++ compiler, so the native CPU kernel cannot build (apt-get install -y g++)",
)
NATIVE = registry.use("cpu_native", block_q=16, block_k=64, bwd_block_q=24, bwd_block_k=64, num_threads=2)

# name: (B, Sq, Sk, Hq, Hkv, D, Dv, options)
CASES = {
    "full": (2, 150, 200, 4, 2, 64, 64, {}),
    "causal_bottom_right": (1, 150, 200, 4, 2, 64, 64, {"causal": True}),
    "causal_top_left": (1, 150, 200, 2, 2, 128, 128, {"causal": True, "align": "top_left"}),
    # Sq > Sk aligned bottom-right: the first 60 query rows see no key (lse -inf, zero gradients).
    "causal_rows_without_keys": (1, 190, 130, 2, 1, 32, 32, {"causal": True}),
    "window": (1, 170, 170, 4, 1, 17, 24, {"window": (30, 5)}),
    "window_left_causal": (2, 100, 260, 2, 2, 64, 64, {"window": (70, None), "causal": True}),
}
# Measured max |error| of out, lse and gradients vs float64: 2e-6 (f32 accumulation over <= 260 keys).
ATOL, RTOL = 2e-5, 1e-5


def _inputs(case, seed=0):
    b, sq, sk, hq, hkv, d, dv, opts = CASES[case]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, dv))
    d_out = rng.standard_normal((b, sq, hq, dv))
    d_lse = rng.standard_normal((b, hq, sq))
    return q, k, v, d_out, d_lse, opts


def _close(got, want, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isfinite(got), np.isfinite(want)), name
    np.testing.assert_allclose(
        np.where(np.isfinite(want), got, 0),
        np.where(np.isfinite(want), want, 0),
        atol=ATOL,
        rtol=RTOL,
        err_msg=name,
    )


@NEEDS_COMPILER
def test_builds_and_auto_picks_it_on_cpu():
    lib, reason = build.load()
    assert reason is None and lib is not None
    assert registry.backends()["cpu_native"]["available"]
    # The benchmark's config (benchmarks/attention_cpu.py): causal, B=1, H=8, D=64, f32.
    q = k = v = jnp.zeros((1, 4096, 8, 64), jnp.float32)
    assert registry.choose("cpu", api.prepare(q, k, v, causal=True)[1])[0] == "cpu_native"
    # A feature it lacks passes the call on to blockwise.
    name, why = registry.choose("cpu", api.prepare(q, k, v, causal=True, softcap=5.0)[1])
    assert name == "blockwise" and "cpu_native: lacks softcap" in why


@NEEDS_COMPILER
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case):
    q, k, v, d_out, d_lse, opts = _inputs(case)
    jq, jk, jv = (jnp.asarray(x, jnp.float32) for x in (q, k, v))

    def forward(q, k, v):
        return flashport.attention(q, k, v, backend=NATIVE, return_lse=True, **opts)

    (out, lse), vjp = jax.vjp(forward, jq, jk, jv)
    want_out, want_lse = reference_attention(q, k, v, **opts)
    _close(out, want_out, "out")
    _close(lse, want_lse, "lse")
    d_lse = np.where(np.isfinite(want_lse), d_lse, 0.0)
    grads = vjp((jnp.asarray(d_out, jnp.float32), jnp.asarray(d_lse, jnp.float32)))
    want = reference_attention_vjp(q, k, v, d_out, d_lse=d_lse, **opts)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[:3], strict=True):
        _close(got, ref, name)
    # The residual backward (attention_backward) is the same kernel.
    res = flashport.attention_backward(
        jq,
        jk,
        jv,
        out,
        lse,
        jnp.asarray(d_out, jnp.float32),
        jnp.asarray(d_lse, jnp.float32),
        backend=NATIVE,
        **opts,
    )
    for name, got, ref in zip(("dq", "dk", "dv"), res[:3], want[:3], strict=True):
        _close(got, ref, f"attention_backward {name}")


@NEEDS_COMPILER
def test_a_wrong_mask_fails_the_comparison():
    """The comparison above can fail: the kernel run with a causal offset off by one differs."""
    q, k, v, _, _, opts = _inputs("causal_bottom_right")
    spec = api.prepare(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), **opts)[1].spec
    shifted = dataclasses.replace(spec, offset=spec.offset + 1)
    canon = [jnp.asarray(x, jnp.float32).transpose(0, 2, 1, 3) for x in (q, k, v)]
    out, _ = native.native_attention(
        *canon, None, None, None, None, None, spec=shifted, options=NATIVE.options_dict
    )
    want, _ = reference_attention(q, k, v, **opts)
    with pytest.raises(AssertionError):
        _close(out.transpose(0, 2, 1, 3), want, "out")


@NEEDS_COMPILER
def test_vmap_jit_grad_match_unbatched():
    q, k, v, _, _, opts = _inputs("causal_bottom_right", seed=3)
    qs, ks, vs = (
        jnp.stack([jnp.asarray(x, jnp.float32), 0.5 * jnp.asarray(x, jnp.float32)]) for x in (q, k, v)
    )

    def loss(q, k, v):
        return jnp.sum(jnp.sin(flashport.attention(q, k, v, backend=NATIVE, **opts)))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    batched = jax.jit(jax.vmap(grad))(qs, ks, vs)
    for n in range(2):
        single = grad(qs[n], ks[n], vs[n])
        for got, want in zip(batched, single, strict=True):
            np.testing.assert_allclose(np.asarray(got[n]), np.asarray(want), atol=1e-6, rtol=1e-6)


@NEEDS_COMPILER
def test_vmap_over_queries_alone_matches_unbatched():
    q, k, v, _, _, opts = _inputs("causal_bottom_right", seed=4)
    qs = jnp.stack([jnp.asarray(q, jnp.float32), -jnp.asarray(q, jnp.float32)])
    k, v = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)

    def run(q):
        return flashport.attention(q, k, v, backend=NATIVE, **opts)

    batched = jax.jit(jax.vmap(run))(qs)
    for n in range(2):
        np.testing.assert_allclose(np.asarray(batched[n]), np.asarray(run(qs[n])), atol=1e-6, rtol=1e-6)


@NEEDS_COMPILER
def test_export_serializes_the_portable_computation():
    """``jax.export`` gets the blockwise XLA computation (no flashport custom call, which would run
    only where flashport registered it), forward and backward, with the same values."""
    q, k, v, _, _, opts = _inputs("causal_bottom_right", seed=5)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))

    def loss(q, k, v):
        return jnp.sum(jnp.sin(flashport.attention(q, k, v, **opts)))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    assert "flashport_cpu" in fn.lower(q, k, v).as_text()  # auto picks the native kernel under jit
    exported = jax.export.export(fn, platforms=["cpu"])(q, k, v)
    assert "flashport_cpu" not in exported.mlir_module()
    got = exported.call(q, k, v)
    want = fn(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=RTOL)


@NEEDS_COMPILER
def test_build_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    cxx = build.compiler()
    assert cxx is not None
    path = build.library_path(cxx)
    assert path.parent == tmp_path and not path.exists()
    build.build(cxx, path)
    stamp = path.stat().st_mtime_ns
    assert build.library_path(cxx) == path  # same inputs, same key: load() reuses it
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left
    assert path.stat().st_mtime_ns == stamp


def test_failed_build_falls_back_to_blockwise(tmp_path, monkeypatch):
    bogus = tmp_path / "bogus-c++"
    bogus.write_text("#!/bin/sh\necho 'bogus compiler: no' >&2\nexit 3\n")
    bogus.chmod(0o755)
    monkeypatch.setenv("FLASHPORT_CXX", str(bogus))
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "load", build.load.__wrapped__)  # no cached success from this process
    lib, reason = build.load()
    assert lib is None and "bogus compiler: no" in reason
    q = jnp.ones((1, 2048, 2, 16), jnp.float32)
    name, why = registry.choose("cpu", api.prepare(q, q, q, causal=True)[1])
    assert name == "blockwise" and "cpu_native: lacks building the native CPU kernel failed" in why
    out = flashport.attention(q, q, q, causal=True)  # auto still runs
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)
