"""``flashport.attention_backward``: gradients from the forward's residuals, no forward recomputed.

Every backend with a residual backward (xla, blockwise, pallas_tpu_interpret) must give the float64
reference's gradients, match ``jax.vjp`` of ``flashport.attention`` including an lse cotangent, and
its lowered backward must not hold the forward's output product P·V (tests/hlo_dots.py). The
recompute fallback (a backend registered without ``backward``) is checked too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_dots import dot_shapes, output_products
from reference import reduce_to_shape, reference_attention_vjp

import flashport
from flashport.kernels.contract import registry

# Sq, Sk, D, Dv all distinct (and distinct from B, H): a dot's shape tells which product it is.
B, SQ, SK, HQ, HKV, D, DV = 2, 40, 56, 4, 2, 16, 24
BACKENDS = {
    "xla": "xla",
    "blockwise": registry.use("blockwise", block_q=16, block_k=8),  # ragged tiles, several blocks
    # block_q divides block_k: masked tiles run per 8-key fine block; 56 keys leave padded fine blocks.
    "blockwise_fine": registry.use("blockwise", block_q=8, block_k=24),
    "pallas_tpu_interpret": "pallas_tpu_interpret",
}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, SQ, HQ, D))
    k = rng.standard_normal((B, SK, HKV, D))
    v = rng.standard_normal((B, SK, HKV, DV))
    return q, k, v, rng


def _cases(rng):
    q_seg = np.sort(rng.integers(0, 3, (B, SQ)), axis=-1)
    kv_seg = np.sort(rng.integers(0, 3, (B, SK)), axis=-1)
    return {
        "causal_gqa": {"causal": True},
        "softcap_window_bias": {
            "softcap": 4.0,
            "window": (9, 3),
            "bias": rng.standard_normal((1, HQ, SQ, SK)),
        },
        "segments_causal_top_left": {
            "q_segment_ids": q_seg,
            "kv_segment_ids": kv_seg,
            "causal": True,
            "align": "top_left",
        },
        "broadcast_bias": {"bias": rng.standard_normal((B, 1, 1, SK))},
        "softcap_window": {"softcap": 4.0, "window": (9, 3)},
    }


CASE_NAMES = ("causal_gqa", "softcap_window_bias", "segments_causal_top_left", "broadcast_bias")


def _jax_kwargs(kw):
    return {
        n: (jnp.asarray(x, jnp.float32) if n == "bias" else jnp.asarray(x))
        if isinstance(x, np.ndarray)
        else x
        for n, x in kw.items()
    }


# The Pallas interpreter is slow on CPU: two cases cover its masks, segments, bias and softcap.
PAIRS = (
    [(b, c) for b in ("xla", "blockwise") for c in CASE_NAMES]
    + [
        ("pallas_tpu_interpret", "softcap_window_bias"),
        ("pallas_tpu_interpret", "segments_causal_top_left"),
    ]
    + [("blockwise_fine", c) for c in ("causal_gqa", "segments_causal_top_left", "softcap_window")]
)


@pytest.mark.parametrize(("backend", "case"), PAIRS)
def test_matches_float64_reference(backend, case):
    q, k, v, rng = _inputs()
    kw = _cases(rng)[case]
    jq, jk, jv = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    out, lse = flashport.attention(jq, jk, jv, backend=BACKENDS[backend], return_lse=True, **_jax_kwargs(kw))
    d_out = rng.standard_normal(out.shape)
    grads = flashport.attention_backward(
        jq, jk, jv, out, lse, jnp.asarray(d_out, jnp.float32), backend=BACKENDS[backend], **_jax_kwargs(kw)
    )
    ref = reference_attention_vjp(q, k, v, d_out, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], ref[:3], strict=True):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5, err_msg=name)
    if "bias" in kw:
        want = reduce_to_shape(ref[3], kw["bias"].shape)
        np.testing.assert_allclose(np.asarray(grads[3]), want, atol=2e-5, rtol=1e-5, err_msg="dbias")
    else:
        assert grads[3] is None


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_lse_cotangent_matches_vjp(backend):
    """With a cotangent on lse too, the residual backward equals jax.vjp of the forward."""
    q, k, v, rng = _inputs(1)
    kw = _jax_kwargs(_cases(rng)["softcap_window_bias"])
    bias = kw.pop("bias")
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [bias]

    def forward(q, k, v, bias):
        return flashport.attention(q, k, v, bias=bias, backend=BACKENDS[backend], return_lse=True, **kw)

    (out, lse), vjp = jax.vjp(forward, *args)
    d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    want = vjp((d_out, d_lse))
    got = flashport.attention_backward(
        *args[:3], out, lse, d_out, d_lse, bias=bias, backend=BACKENDS[backend], **kw
    )
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("backend", ["xla", "blockwise", "blockwise_fine", "pallas_tpu_interpret"])
def test_dropout_matches_float64_reference(backend):
    """Each residual backward regenerates the dropout mask from the seed (same mask as the forward)."""
    q, k, v, rng = _inputs(2)
    key = jax.random.key(42)
    jq, jk, jv = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    kw = dict(causal=True, dropout_rate=0.25, dropout_rng=key)
    kw["backend"] = BACKENDS[backend] if backend == "blockwise_fine" else backend
    out, lse = flashport.attention(jq, jk, jv, return_lse=True, **kw)
    d_out = rng.standard_normal(out.shape)
    grads = flashport.attention_backward(jq, jk, jv, out, lse, jnp.asarray(d_out, jnp.float32), **kw)
    ref = reference_attention_vjp(q, k, v, d_out, causal=True, dropout_rate=0.25, dropout_seed=(0, 42))
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], ref[:3], strict=True):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5, err_msg=name)


def test_bhsd_bfloat16_shapes_and_dtypes():
    q, k, v, _rng = _inputs(3)
    jq, jk, jv = (jnp.asarray(x.transpose(0, 2, 1, 3), jnp.bfloat16) for x in (q, k, v))
    out, lse = flashport.attention(jq, jk, jv, layout="BHSD", causal=True, return_lse=True)
    d_out = jnp.ones_like(out)
    got = flashport.attention_backward(jq, jk, jv, out, lse, d_out, layout="BHSD", causal=True)
    _, vjp = jax.vjp(lambda q, k, v: flashport.attention(q, k, v, layout="BHSD", causal=True), jq, jk, jv)
    for g, w in zip(got[:3], vjp(d_out), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2, rtol=2e-2)
    assert got[3] is None


def test_no_keys_gives_zero_gradients():
    q = jnp.ones((1, 3, 2, 8), jnp.float32)
    k = jnp.ones((1, 0, 2, 8), jnp.float32)
    out, lse = flashport.attention(q, k, k, return_lse=True)
    dq, dk, dv, dbias = flashport.attention_backward(
        q, k, k, out, lse, jnp.ones_like(out), jnp.ones_like(lse)
    )
    assert not np.any(np.asarray(dq)) and dk.shape == k.shape and dv.shape == k.shape and dbias is None


def test_wrong_residual_shape_is_named():
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    out, lse = flashport.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="lse must have the forward's shape"):
        flashport.attention_backward(q, q, q, out, lse[:, :, :2], out)


def _backward_hlo(backward_fn, backend):
    q, k, v, _ = _inputs()
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out, lse = flashport.attention(*args, causal=True, backend=BACKENDS[backend], return_lse=True)
    return (
        jax.jit(backward_fn)
        .lower(*args, out, lse, jnp.ones_like(out), jnp.ones_like(lse))
        .as_text(dialect="hlo")
    )


def _residual_backward(backend):
    def fn(q, k, v, out, lse, d_out, d_lse):
        return flashport.attention_backward(
            q, k, v, out, lse, d_out, d_lse, causal=True, backend=BACKENDS[backend]
        )

    return fn


def _recomputing_backward(backend):
    """The old call_jax backward: jax.vjp of the forward inside the backward."""

    def fn(q, k, v, out, lse, d_out, d_lse):
        forward = lambda q, k, v: flashport.attention(  # noqa: E731
            q, k, v, causal=True, backend=BACKENDS[backend], return_lse=True
        )
        return jax.vjp(forward, q, k, v)[1]((d_out, d_lse))

    return fn


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_backward_hlo_holds_no_forward_product(backend):
    """The residual backward's HLO has no P·V dot; the recomputing backward's has (the check can fail)."""
    residual = _backward_hlo(_residual_backward(backend), backend)
    recomputing = _backward_hlo(_recomputing_backward(backend), backend)
    # blockwise tiles hold the G query heads of a kv head as rows: G * block_q query rows per dot.
    rows = SQ if backend == "xla" else (HQ // HKV) * 16
    assert output_products(residual, rows, DV) == []
    assert output_products(recomputing, rows, DV) != []
    assert len(dot_shapes(residual)) < len(dot_shapes(recomputing))


def test_xla_backward_has_five_matmuls():
    """Scores Q·Kᵀ once, then dV, dP, dQ, dK: five dots (the recomputing backward has six)."""
    assert len(dot_shapes(_backward_hlo(_residual_backward("xla"), "xla"))) == 5
    assert len(dot_shapes(_backward_hlo(_recomputing_backward("xla"), "xla"))) == 6


def test_backend_without_residual_backward_recomputes():
    """A backend registered without ``backward`` gets exact gradients from the jax.vjp fallback,
    which does recompute the forward (its HLO holds the P·V product)."""
    info = registry.get("xla")
    registry.register(dataclasses.replace(info, name="xla_no_bwd", backward=None))
    BACKENDS["xla_no_bwd"] = "xla_no_bwd"
    try:
        q, k, v, rng = _inputs(4)
        args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
        out, lse = flashport.attention(*args, causal=True, backend="xla_no_bwd", return_lse=True)
        d_out = rng.standard_normal(out.shape)
        grads = flashport.attention_backward(
            *args, out, lse, jnp.asarray(d_out, jnp.float32), causal=True, backend="xla_no_bwd"
        )
        assert grads[3] is None
        for got, want in zip(
            grads[:3], reference_attention_vjp(q, k, v, d_out, causal=True)[:3], strict=True
        ):
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
        hlo = _backward_hlo(_residual_backward("xla_no_bwd"), "xla_no_bwd")
        assert output_products(hlo, SQ, DV) != []
    finally:
        registry._REGISTRY.pop("xla_no_bwd")
        BACKENDS.pop("xla_no_bwd")
