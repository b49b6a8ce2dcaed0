"""The ``splash`` backend (JAX's splash attention) against the float64 reference, in the interpreter.

``splash_interpret`` runs the very kernels ``backend="splash"`` runs on TPU (Pallas interpreter on
CPU): forward and the gradients of splash's own custom_vjp for every feature it claims, and a
refusal, naming its reason, for every call it cannot serve exactly. The real TPU compile of the
forward and gradient is in ``tests/test_splash_tpu_compile.py``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.backends import splash
from flashport.kernels.contract import api, registry
from flashport.kernels.contract.spec import make_spec, positional_visible

BACKEND = "splash_interpret"
TOL = {"float32": (2e-5, 1e-4), "bfloat16": (3e-2, 6e-2)}


def inputs(seed, *, sq=256, sk=256, hq=4, hkv=2, d=64, layout="BSHD", dtype="float32"):
    """Random q, k, v in ``layout`` and an output cotangent (float32 numpy)."""
    rng = np.random.default_rng(seed)
    qs, ks = ((2, sq, hq, d), (2, sk, hkv, d)) if layout == "BSHD" else ((2, hq, sq, d), (2, hkv, sk, d))
    q, k, v, d_out = (rng.standard_normal(s).astype(np.float32) for s in (qs, ks, ks, qs))
    return *(jnp.asarray(x, dtype) for x in (q, k, v)), d_out


def segments(seed, b, s, ids):
    """Sorted random segment ids in [0, ids) (packed documents), int32 [b, s]."""
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, ids, (b, s)), axis=1), jnp.int32)


def assert_close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"


CASES = {
    "plain_gqa": dict(),
    "mha": dict(shape=dict(hkv=4)),
    "mqa_causal": dict(shape=dict(hkv=1), opts=dict(causal=True)),
    "bhsd_scale": dict(shape=dict(layout="BHSD"), opts=dict(scale=0.3)),
    "causal_square": dict(opts=dict(causal=True)),
    "causal_top_left_square": dict(opts=dict(causal=True, align="top_left")),
    "causal_bottom_right_sq<sk": dict(shape=dict(sq=128, sk=384), opts=dict(causal=True)),
    "causal_top_left_sq<sk": dict(shape=dict(sq=128, sk=384), opts=dict(causal=True, align="top_left")),
    "causal_top_left_sq>sk": dict(shape=dict(sq=384, sk=128), opts=dict(causal=True, align="top_left")),
    "window_both": dict(opts=dict(window=(40, 9))),
    # Bottom-right with Sq > Sk: a negative mask offset, every row still sees a key.
    "window_bottom_right_sq>sk": dict(shape=dict(sq=384, sk=256), opts=dict(window=(300, 200))),
    "window_left_causal_sq<sk": dict(shape=dict(sq=128, sk=256), opts=dict(causal=True, window=(70, None))),
    "softcap": dict(opts=dict(softcap=2.0, scale=1.0, causal=True)),
    "segments": dict(segments=3),
    # Random ids in both sequences: some query rows see no key of their segment (out 0, grads 0).
    "segments_causal_window_empty_rows": dict(segments=4, opts=dict(causal=True, window=(50, None))),
}


def run_case(case, dtype="float32", seed=0, backend=BACKEND):
    """Forward and gradients of the case on ``backend`` and on the float64 reference."""
    q, k, v, d_out = inputs(seed, dtype=dtype, **case.get("shape", {}))
    kwargs = dict(case.get("opts", {}), layout=case.get("shape", {}).get("layout", "BSHD"))
    if "segments" in case:
        bshd = kwargs["layout"] == "BSHD"
        sq, sk = (q.shape[1], k.shape[1]) if bshd else (q.shape[2], k.shape[2])
        kwargs["q_segment_ids"] = segments(seed + 1, 2, sq, case["segments"])
        kwargs["kv_segment_ids"] = segments(seed + 2, 2, sk, case["segments"])

    def fwd(q, k, v):
        return flashport.attention(q, k, v, backend=backend, **kwargs)

    out, vjp = jax.vjp(fwd, q, k, v)
    grads = vjp(jnp.asarray(d_out, dtype))
    want_out, _ = reference_attention(q, k, v, **kwargs)
    want_grads = reference_attention_vjp(q, k, v, d_out, **kwargs)[:3]
    return out, grads, want_out, want_grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name):
    out, grads, want_out, want_grads = run_case(CASES[name])
    fwd_tol, grad_tol = TOL["float32"]
    assert out.dtype == jnp.float32 and out.shape == want_out.shape
    assert_close(out, want_out, fwd_tol, "out")
    for what, got, want in zip("qkv", grads, want_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(got))), f"d{what} has non-finite values"
        assert_close(got, want, grad_tol, f"d{what}")


def test_rows_without_keys_are_zero_with_zero_gradients():
    case = dict(segments=4, opts=dict(causal=True, window=(50, None)))
    out, grads, want_out, _ = run_case(case)
    empty = np.all(np.asarray(want_out) == 0, axis=-1)  # BSHD [B, Sq, H]
    assert empty.any(), "the case must have query rows that see no key"
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0.0)


def test_bfloat16_matches_reference():
    out, grads, want_out, want_grads = run_case(dict(shape=dict(hkv=1), opts=dict(causal=True)), "bfloat16")
    fwd_tol, grad_tol = TOL["bfloat16"]
    assert out.dtype == jnp.bfloat16
    assert_close(out, want_out, fwd_tol, "out")
    for what, got, want in zip("qkv", grads, want_grads, strict=True):
        assert_close(got, want, grad_tol, f"d{what}")


def test_block_options_are_used_and_checked():
    # A fused backward kernel with 128 blocks on a 384-long sequence still matches the reference.
    backend = registry.use(BACKEND, block_q=128, block_kv=128, use_fused_bwd_kernel=True)
    case = dict(shape=dict(sq=384, sk=384), opts=dict(causal=True))
    out, grads, want_out, want_grads = run_case(case, backend=backend)
    assert_close(out, want_out, TOL["float32"][0], "out")
    assert_close(grads[1], want_grads[1], TOL["float32"][1], "dk")
    assert splash.block_sizes({}, 384, 1024).block_q == 128
    assert splash.block_sizes({}, 384, 1024).block_kv == 512
    q, k, v, _ = inputs(0)
    for options, message in (
        (dict(block_q=256 + 128), "must divide the sequence length 256"),
        (dict(block_kv=100), "positive multiple of 128"),
        (dict(blok_q=128), "unknown options"),
        (dict(use_fused_bwd_kernel=1), "must be a bool"),
    ):
        with pytest.raises(ValueError, match=message):
            flashport.attention(q, k, v, backend=registry.use(BACKEND, **options))


def _arrays(sq=256, sk=256, dtype="float32", d=64, dv=64):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, sq, 4, d)), dtype)
    k = jnp.asarray(rng.standard_normal((2, sk, 2, d)), dtype)
    v = jnp.asarray(rng.standard_normal((2, sk, 2, dv)), dtype)
    return q, k, v


REFUSALS = {
    "ragged": (dict(sq=300), {}, "multiples of 128"),
    "value head_dim": (dict(dv=32), {}, "value head_dim differs"),
    "bottom-right sq>sk": (dict(sq=384, sk=256), dict(causal=True), "query row 0 sees no key"),
    "window past the keys": (
        dict(sq=256, sk=128),
        dict(window=(0, 0), align="top_left"),
        "row 128 sees no key",
    ),
    "float16": (dict(dtype="float16"), {}, "float16"),
    "bias": ({}, dict(bias=jnp.zeros((1, 1, 256, 256))), "bias"),
    "mask": ({}, dict(mask=jnp.ones((1, 1, 256, 256), bool)), "mask"),
    "dropout": ({}, dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout"),
    "return_lse": ({}, dict(return_lse=True), "return_lse"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
@pytest.mark.parametrize("backend", ["splash", BACKEND])
def test_refuses_what_it_cannot_serve_before_lowering(name, backend):
    shape, kwargs, reason = REFUSALS[name]
    q, k, v = _arrays(**shape)
    with pytest.raises(ValueError, match=rf"backend='{backend}' does not support this call: .*{reason}"):
        jax.jit(lambda q, k, v: flashport.attention(q, k, v, backend=backend, **kwargs)).trace(q, k, v)


def test_listed_and_never_picked_by_auto():
    rows = flashport.backends()
    assert rows["splash"]["platforms"] == ["tpu"] and rows["splash_interpret"]["platforms"] == ["cpu"]
    assert rows["splash"]["features"]["segment_ids"] and not rows["splash"]["features"]["bias"]
    call = api.prepare(*_arrays(), causal=True)[1]
    for platform in ("tpu", "cpu"):
        assert registry.choose(platform, call)[0] not in ("splash", "splash_interpret")
    assert all("splash" not in names for names in registry.AUTO_PREFERENCE.values())


@pytest.mark.parametrize(
    "causal,window,align,sq,sk",
    [
        (c, w, a, sq, sk)
        for c, w, a, (sq, sk) in itertools.product(
            (False, True),
            (None, (0, 0), (3, None), (None, 2), (5, 1)),
            ("bottom_right", "top_left"),
            ((7, 7), (5, 13), (13, 5)),
        )
    ],
)
def test_first_row_without_keys_matches_brute_force(causal, window, align, sq, sk):
    spec = make_spec(
        (1, 1, sq, 8), (1, 1, sk, 8), scale=None, causal=causal, window=window, align=align, softcap=None
    )
    visible = positional_visible(spec, np.arange(sq)[:, None], np.arange(sk)[None, :])
    empty = np.flatnonzero(~np.broadcast_to(visible, (sq, sk)).any(axis=1))
    assert splash.first_row_without_keys(spec) == (int(empty[0]) if empty.size else None)
