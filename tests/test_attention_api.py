"""flashport.attention against the independent float64 reference: features, gradients, transforms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reduce_to_shape, reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.contract import registry

# Small blocks so every case spans several query and key blocks, ragged tails included.
BLOCKWISE = registry.use("blockwise", block_q=8, block_k=16)
# The Pallas GPU kernels through their interpreter twin, with Triton's smallest tiles (slow: the
# default run covers every feature of it in tests/test_pallas_gpu.py).
PALLAS_GPU = registry.use("pallas_gpu_interpret", block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
BACKENDS = {"xla": "xla", "blockwise": BLOCKWISE, "pallas_gpu_interpret": PALLAS_GPU}
SLOW_BACKENDS = {"pallas_gpu_interpret"}
BACKEND_PARAMS = [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_BACKENDS else name for name in sorted(BACKENDS)
]
# float32 against float64: forward 2e-5, gradients 1e-4 (relative to the gradient's scale).
TOL = {"float32": (2e-5, 1e-4), "bfloat16": (3e-2, 6e-2), "float16": (4e-3, 1e-2)}


def make_inputs(seed, b=2, sq=13, sk=29, hq=4, hkv=2, d=16, layout="BSHD", dtype="float32"):
    """Random q, k, v (in ``layout``) and an output cotangent."""
    rng = np.random.default_rng(seed)
    qs, ks = ((b, sq, hq, d), (b, sk, hkv, d)) if layout == "BSHD" else ((b, hq, sq, d), (b, hkv, sk, d))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (qs, ks, ks))
    d_out = rng.standard_normal(qs).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), d_out


CASES = {
    "plain": dict(),
    "bhsd": dict(layout="BHSD"),
    "mha": dict(hkv=4),
    "mqa": dict(hkv=1),
    "scale": dict(opts=dict(scale=0.3)),
    "causal_br_sq<sk": dict(opts=dict(causal=True)),
    "causal_tl_sq<sk": dict(opts=dict(causal=True, align="top_left")),
    "causal_br_sq>sk": dict(sq=29, sk=13, opts=dict(causal=True)),  # leading rows are empty
    "causal_tl_sq>sk": dict(sq=29, sk=13, opts=dict(causal=True, align="top_left")),
    "causal_square": dict(sq=24, sk=24, opts=dict(causal=True)),
    "window_both": dict(opts=dict(window=(5, 3))),
    "window_left_causal": dict(opts=dict(window=(7, None), causal=True)),
    "window_right_only_tl": dict(opts=dict(window=(None, 2), align="top_left")),
    "window_sq>sk": dict(sq=29, sk=13, opts=dict(window=(4, 0))),
    "softcap": dict(opts=dict(softcap=2.0, scale=1.0)),
    "bias_full": dict(bias=(2, 4, 13, 29)),
    "bias_broadcast": dict(bias=(1, 4, 1, 29), opts=dict(causal=True)),
    "bias_2d": dict(bias=(13, 29), opts=dict(softcap=5.0)),
    "mask": dict(mask=(2, 1, 13, 29)),
    "mask_empty_rows": dict(mask="empty_rows"),
    "segments": dict(segments=True),
    "segments_causal_window": dict(segments=True, opts=dict(causal=True, window=(6, None))),
    "decode": dict(sq=1, sk=37, opts=dict(causal=True)),
    "everything": dict(
        hkv=1,
        bias=(2, 1, 13, 29),
        mask=(1, 4, 13, 29),
        segments=True,
        opts=dict(causal=True, window=(9, None), softcap=4.0, scale=0.2),
    ),
}


def build(case, seed=0, dtype="float32"):
    """Turn a CASES entry into (q, k, v, d_out, kwargs)."""
    shape = {k: case[k] for k in ("b", "sq", "sk", "hq", "hkv", "d", "layout") if k in case}
    q, k, v, d_out = make_inputs(seed, dtype=dtype, **shape)
    layout = case.get("layout", "BSHD")
    b, sq, hq = (
        (q.shape[0], q.shape[1], q.shape[2]) if layout == "BSHD" else (q.shape[0], q.shape[2], q.shape[1])
    )
    sk = k.shape[1] if layout == "BSHD" else k.shape[2]
    kwargs = dict(case.get("opts", {}), layout=layout)
    rng = np.random.default_rng(seed + 1)
    if "bias" in case:
        kwargs["bias"] = jnp.asarray(rng.standard_normal(case["bias"]), jnp.float32)
    if case.get("mask") == "empty_rows":
        mask = rng.random((b, hq, sq, sk)) < 0.5
        mask[:, :, ::3, :] = False  # every third query row sees nothing
        kwargs["mask"] = jnp.asarray(mask)
    elif "mask" in case:
        kwargs["mask"] = jnp.asarray(rng.random(case["mask"]) < 0.6)
    if case.get("segments"):
        kwargs["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, sq)), axis=1))
        kwargs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, sk)), axis=1))
    return q, k, v, d_out, kwargs


def assert_close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"


def check_against_reference(q, k, v, d_out, kwargs, backend, dtype="float32"):
    """Forward, lse and all gradients (bias too) against the float64 reference."""
    fwd_tol, grad_tol = TOL[dtype]
    bias = kwargs.pop("bias", None)

    def run(q, k, v, bias):
        return flashport.attention(q, k, v, bias=bias, backend=backend, return_lse=True, **kwargs)

    (out, lse), vjp = jax.vjp(run, q, k, v, bias)
    ref_kwargs = dict(kwargs, bias=bias)
    want_out, want_lse = reference_attention(q, k, v, **ref_kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == want_lse.shape
    assert_close(out, want_out, fwd_tol, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert_close(np.asarray(lse)[finite], want_lse[finite], fwd_tol, "lse")

    grads = vjp((jnp.asarray(d_out, q.dtype), jnp.zeros_like(lse)))
    want = reference_attention_vjp(q, k, v, d_out, **ref_kwargs)
    for name, got, ref in zip("qkv", grads[:3], want[:3], strict=True):
        assert np.all(np.isfinite(np.asarray(got, np.float32))), f"d{name} has non-finite values"
        assert_close(got, ref, grad_tol, f"d{name}")
    if bias is not None:
        assert_close(grads[3], reduce_to_shape(want[3], bias.shape), grad_tol, "dbias")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name, backend):
    q, k, v, d_out, kwargs = build(CASES[name])
    check_against_reference(q, k, v, d_out, kwargs, BACKENDS[backend])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_low_precision(dtype, backend):
    q, k, v, d_out, kwargs = build(CASES["everything"], dtype=dtype)
    check_against_reference(q, k, v, d_out, kwargs, BACKENDS[backend], dtype=dtype)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_empty_rows_are_zero_with_zero_gradients(backend):
    q, k, v, _, kwargs = build(CASES["causal_br_sq>sk"])
    out, lse = flashport.attention(q, k, v, backend=BACKENDS[backend], return_lse=True, **kwargs)
    empty = 29 - 13  # bottom-right causal: the first Sq - Sk query rows see no key
    assert np.all(np.asarray(out)[:, :empty] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :empty]))
    dq = jax.grad(lambda q: flashport.attention(q, k, v, backend=BACKENDS[backend], **kwargs).sum())(q)
    assert np.all(np.asarray(dq)[:, :empty] == 0) and np.all(np.isfinite(np.asarray(dq)))


@pytest.mark.parametrize("backend", [*BACKEND_PARAMS, "pallas_tpu_interpret"])
def test_lse_is_differentiable(backend):
    q, k, v, _, kwargs = build(CASES["causal_br_sq>sk"])

    def lse_sum(q, k, v):
        _, lse = flashport.attention(
            q, k, v, backend=BACKENDS.get(backend, backend), return_lse=True, **kwargs
        )
        return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.grad(lse_sum, argnums=(0, 1, 2))(q, k, v)
    # d lse_i / d s_ij = p_ij: the same as the output's gradient with V = 0 and a unit cotangent on
    # a constant value column, which the reference gives as: dq = scale * P K, dk = scale * Pᵀ Q.
    qd, kd = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k))
    kr = np.repeat(kd, qd.shape[1] // kd.shape[1], axis=1)
    scale = 1 / np.sqrt(qd.shape[-1])
    ones = np.ones(v.shape, np.float64)
    out, _ = reference_attention(q, k, ones, **kwargs)  # 1 where a row sees keys, 0 where empty
    p_rows = out.transpose(0, 2, 1, 3)[..., :1]
    s = np.einsum("bhqd,bhkd->bhqk", qd, kr) * scale
    offset = kd.shape[2] - qd.shape[2]
    keep = np.arange(kd.shape[2])[None, :] <= np.arange(qd.shape[2])[:, None] + offset
    s = np.where(keep, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.where(p_rows > 0, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = p / np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1)
    want_dq = scale * np.einsum("bhqk,bhkd->bhqd", p, kr).transpose(0, 2, 1, 3)
    assert_close(grads[0], want_dq, 1e-4, "d sum(lse) / dq")
    assert np.all(np.asarray(grads[2]) == 0)


def test_auto_matches_reference_long_and_short():
    for sk in (40, 1100):  # below and above the CPU blockwise threshold
        q, k, v, d_out, kwargs = build(dict(sq=17, sk=sk, opts=dict(causal=True, window=(300, None))))
        check_against_reference(q, k, v, d_out, kwargs, "auto")


def test_jit_vmap_grad_compose():
    q, k, v, _, kwargs = build(CASES["causal_br_sq<sk"])
    qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))  # an extra leading axis for vmap

    def loss(q, k, v):
        return jnp.sum(flashport.attention(q, k, v, backend=BLOCKWISE, **kwargs) ** 2)

    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(qs, ks, vs)
    for idx in range(2):
        single = jax.grad(loss, argnums=(0, 1, 2))(qs[idx], ks[idx], vs[idx])
        for got, want in zip(batched, single, strict=True):
            np.testing.assert_allclose(got[idx], want, rtol=1e-5, atol=1e-5)
    out = jax.vmap(lambda q, k, v: flashport.attention(q, k, v, **kwargs))(qs, ks, vs)
    want, _ = reference_attention(qs[1], ks[1], vs[1], **kwargs)
    assert_close(out[1], want, 2e-5, "vmap out")


def test_visible_in_jaxpr_and_hlo_with_flops():
    q, k, v, _, _ = build(dict(sq=64, sk=64, hkv=4))
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: flashport.attention(q, k, v, backend="xla"))(q, k, v))
    assert "name=flashport_attention" in jaxpr
    lowered = jax.jit(lambda q, k, v: flashport.attention(q, k, v, backend="xla")).lower(q, k, v)
    assert "flashport_attention" in lowered.as_text(debug_info=True)  # op_name metadata for profiles
    flops = lowered.compile().cost_analysis()["flops"]
    b, s, h, d = q.shape
    matmul_flops = 4 * b * h * s * s * d
    assert matmul_flops <= flops <= 2 * matmul_flops


def test_debug_log_names_backend(caplog):
    q, k, v, _, _ = build(dict(sq=8, sk=8))
    with caplog.at_level("DEBUG", logger="flashport"):
        jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True))(q, k, v)
    text = caplog.text
    assert "auto picks" in text and "cpu->xla" in text and "running backend" in text


def test_backends_report():
    report = flashport.backends()
    assert {"xla", "blockwise", "cudnn"} <= set(report)
    assert report["xla"]["available"] and report["blockwise"]["available"]
    assert report["blockwise"]["features"]["softcap"] and not report["cudnn"]["features"]["softcap"]


def test_explicit_backend_lacking_feature_names_it():
    q, k, v, _, _ = build(dict(dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"backend='cudnn' does not support .*softcap.*blockwise"):
        flashport.attention(q, k, v, softcap=3.0, backend="cudnn")


def test_cudnn_dispatch_guards(monkeypatch):
    from flashport.kernels.backends import cudnn
    from flashport.kernels.contract import api

    def call(dtype="bfloat16", shape=None, **kw):
        # Even lengths: jax's cuDNN path needs them when differentiated (cudnn refuses odd ones).
        q, k, v, _ = make_inputs(0, dtype=dtype, **dict(dict(sq=12, sk=28), **(shape or {})))
        return api.prepare(q, k, v, **kw)[1]

    monkeypatch.setattr(cudnn, "cuda_present", lambda: True)
    assert cudnn.check_call(call()) is None
    assert cudnn.check_call(call(causal=True, align="top_left")) is None
    assert cudnn.check_call(call(shape=dict(sq=16, sk=16), causal=True)) is None
    assert "bottom-right" in cudnn.check_call(call(causal=True))
    assert "reaches right" in cudnn.check_call(call(window=(4, 2), align="top_left"))
    assert cudnn.check_call(call(window=(4, 0), align="top_left")) is None
    assert "head_dim=160" in cudnn.check_call(call(shape=dict(d=160)))
    assert "odd sequence length" in cudnn.check_call(call(shape=dict(sq=13)))
    assert registry.missing_features(registry.get("cudnn"), call(dtype="float32")) == ["float32"]
    assert registry.choose("cuda", call(softcap=2.0))[0] == "pallas_gpu"  # the Triton kernel serves softcap
    monkeypatch.setattr(cudnn, "cuda_present", lambda: False)
    assert "CUDA device" in cudnn.check_call(call())


def test_export_for_several_platforms():
    q, k, v, _, _ = build(dict(sq=16, sk=1100))
    # auto's CUDA branch is the pallas_gpu Triton kernel and its CPU branch the cpu_native kernel,
    # whose custom calls have no cross-version compatibility guarantee (the native one runs only
    # where flashport registered it): exporting them must be allowed explicitly.
    exported = jax.export.export(
        jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True)),
        platforms=["cpu", "cuda"],
        disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(target)
            for target in ("__gpu$xla.gpu.triton", "flashport_cpu_forward")
        ],
    )(q, k, v)
    out = exported.call(q, k, v)
    want, _ = reference_attention(q, k, v, causal=True)
    assert_close(out, want, 2e-5, "exported out")


BAD_INPUTS = [
    (dict(q_shape=(2, 13, 4)), ValueError, "query must have rank 4"),
    (dict(kw=dict(layout="BTHD")), ValueError, "layout='BTHD'"),
    (dict(kw=dict(align="center")), ValueError, "align='center'"),
    (dict(kw=dict(backend="flash")), ValueError, "backend='flash' is not a flashport backend"),
    (dict(k_dim=8), ValueError, "key head_dim must equal query head_dim"),
    (dict(k_heads=3), ValueError, r"key/value heads \(3\) must divide query heads \(4\)"),
    (dict(kw=dict(window=(-1, 0))), ValueError, "window left must be >= 0"),
    (dict(kw=dict(window=5)), ValueError, r"window must be a \(left, right\) pair"),
    (dict(kw=dict(mask=np.ones((2, 4, 13, 28), bool))), ValueError, "mask of shape .* does not broadcast"),
    (dict(kw=dict(mask=np.ones((13, 29), np.float32))), TypeError, "mask must be boolean"),
    (dict(kw=dict(bias=np.ones((3, 4, 13, 29), np.float32))), ValueError, "bias of shape"),
    (dict(kw=dict(q_segment_ids=np.zeros((2, 13), np.int32))), ValueError, "must be given together"),
    (
        dict(kw=dict(q_segment_ids=np.zeros((2, 12), np.int32), kv_segment_ids=np.zeros((2, 29), np.int32))),
        ValueError,
        r"q_segment_ids must have shape \[batch, seq\]",
    ),
    (dict(kw=dict(softcap=-1.0)), ValueError, "softcap must be > 0"),
    (dict(kw=dict(scale=jnp.float32(2.0) * jnp.ones(()))), TypeError, "scale must be a static Python float"),
    (dict(dtype=np.int32), TypeError, "query must be float32, bfloat16 or float16"),
]


@pytest.mark.parametrize("case,error,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_is_named(case, error, message):
    q, k, v, _ = make_inputs(0)
    if "q_shape" in case:
        q = jnp.zeros(case["q_shape"], jnp.float32)
    if "k_dim" in case:
        k = jnp.zeros(k.shape[:3] + (case["k_dim"],), jnp.float32)
    if "k_heads" in case:
        k = v = jnp.zeros(k.shape[:2] + (case["k_heads"], k.shape[3]), jnp.float32)
    if "dtype" in case:
        q = q.astype(case["dtype"])
    with pytest.raises(error, match=message):
        flashport.attention(q, k, v, **case.get("kw", {}))
