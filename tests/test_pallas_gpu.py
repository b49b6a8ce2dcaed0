"""The Pallas GPU (Triton) kernels, run by the Pallas interpreter on CPU, against the float64 reference.

Every case goes through ``flashport.attention(..., backend=pallas_gpu_interpret)`` with 16-row/
16-key blocks (the Triton minimum) so each call spans several query and key blocks with ragged tails,
and checks out, lse and the gradients of q, k, v (and bias) against ``tests/reference.py``.

Tolerances (max abs error relative to max(1, max|reference|)): float32 forward 2e-5 and gradients
1e-4 (the kernels multiply float32 without TF32); bfloat16 3e-2 / 6e-2; float16 4e-3 / 1e-2 (inputs
are rounded to the dtype before the reference sees them).

The real Triton lowering cannot run here, but it can be lowered: ``test_lowers_for_cuda`` lowers
forward and backward for platform ``cuda`` on this CPU-only host (Pallas -> Triton IR), which
catches unsupported shapes and ops without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from band_spec import band_spec
from reference import reduce_to_shape, reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.backends.pallas_gpu.tiling import (
    Geometry,
    full_key_blocks,
    full_query_blocks,
    key_block_bounds,
    query_block_bounds,
)
from flashport.kernels.contract import api, registry

SMALL = registry.use("pallas_gpu_interpret", block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=32)
TOL = {"float32": (2e-5, 1e-4), "bfloat16": (3e-2, 6e-2), "float16": (4e-3, 1e-2)}


def make_case(
    seed=0,
    b=1,
    sq=40,
    sk=72,
    hq=2,
    hkv=1,
    d=16,
    dv=None,
    dtype="float32",
    bias=None,
    mask=None,
    segments=False,
    empty_rows=False,
    **opts,
):
    """Random inputs in BSHD plus the keyword arguments of the call."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hkv, dv or d)).astype(np.float32)
    d_out = rng.standard_normal((b, sq, hq, dv or d)).astype(np.float32)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    kwargs = dict(opts)
    if bias is not None:
        kwargs["bias"] = jnp.asarray(rng.standard_normal(bias), jnp.float32)
    if mask is not None:
        m = rng.random(mask) < 0.7
        if empty_rows:
            m[..., ::5, :] = False
        kwargs["mask"] = jnp.asarray(m)
    if segments:
        kwargs["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, sq)), axis=1), jnp.int32)
        kwargs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, sk)), axis=1), jnp.int32)
    return q, k, v, d_out, kwargs


def assert_close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"


def check(q, k, v, d_out, kwargs, backend=SMALL, dtype="float32", grads=True):
    """Forward, lse and (optionally) all gradients against the float64 reference."""
    fwd_tol, grad_tol = TOL[dtype]
    kwargs = dict(kwargs)
    bias = kwargs.pop("bias", None)
    ref_kwargs = dict(kwargs, bias=bias)
    seed = kwargs.pop("dropout_seed", None)  # the two uint32 seed words, passed as a raw key
    if seed is not None:
        kwargs["dropout_rng"] = jnp.asarray(seed, jnp.uint32)

    def run(q, k, v, bias):
        return flashport.attention(q, k, v, bias=bias, backend=backend, return_lse=True, **kwargs)

    want_out, want_lse = reference_attention(q, k, v, **ref_kwargs)
    if grads:
        (out, lse), vjp = jax.vjp(run, q, k, v, bias)
    else:
        out, lse = run(q, k, v, bias)
    assert out.dtype == q.dtype and out.shape == want_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == want_lse.shape
    assert_close(out, want_out, fwd_tol, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert_close(np.asarray(lse)[finite], want_lse[finite], fwd_tol, "lse")
    if not grads:
        return
    got = vjp((jnp.asarray(d_out, q.dtype), jnp.zeros_like(lse)))
    want = reference_attention_vjp(q, k, v, jnp.asarray(d_out, q.dtype), **ref_kwargs)
    for name, g, w in zip("qkv", got[:3], want[:3], strict=True):
        assert g.dtype == q.dtype, f"d{name} dtype {g.dtype}"
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"d{name} has non-finite values"
        assert_close(g, w, grad_tol, f"d{name}")
    if bias is not None:
        assert got[3].shape == bias.shape
        assert_close(got[3], reduce_to_shape(want[3], bias.shape), grad_tol, "dbias")


# Each case combines several features so the matrix stays small; together they cover every feature,
# both alignments with Sq < Sk and Sq > Sk, GQA ratios 1/2/4, ragged lengths (40 and 72 are not
# multiples of 16 or 32), head dims 16/24/32 (24 is padded to 32), every bias broadcast layout of the
# bias gradient, Sq = 1 and rows that see no key.
CASES = {
    "plain_mqa_ragged": dict(),
    "causal_br_gqa_dv": dict(hq=4, hkv=2, causal=True, d=32, dv=16),
    "causal_tl_sq>sk_mha": dict(sq=72, sk=40, hkv=2, causal=True, align="top_left"),
    "causal_br_sq>sk_empty_rows": dict(sq=72, sk=40, hq=1, causal=True),
    "window_softcap_scale_d24": dict(window=(20, 5), softcap=2.5, scale=0.3, d=24),
    "window_left_tl_bias_full": dict(window=(30, None), align="top_left", bias=(1, 2, 40, 72)),
    "bias_keys_mask_segments_causal": dict(
        b=2, hq=1, bias=(2, 1, 1, 72), mask=(1, 1, 40, 72), segments=True, causal=True
    ),
    "bias_rows_softcap": dict(hq=4, hkv=2, bias=(1, 4, 40, 1), softcap=3.0),
    "bias_scalar_window": dict(bias=(1, 1, 1, 1), window=(8, 8)),
    "mask_empty_rows": dict(mask=(1, 2, 40, 72), empty_rows=True),
    "dropout_gqa_causal_bias": dict(
        hq=4, hkv=2, causal=True, dropout_rate=0.25, dropout_seed=(0, 7), bias=(1, 4, 40, 72)
    ),
    "dropout_segments_window_tl": dict(
        b=2, dropout_rate=0.5, dropout_seed=(3, 11), segments=True, window=(16, 0), align="top_left"
    ),
    "decode_sq1": dict(sq=1, hq=4, causal=True, bias=(1, 4, 1, 72)),
    # sorted ids over 64 positions: tiles pairing different id ranges are skipped, and the dQ kernel
    # writes their (zero) full-layout bias gradient
    "segments_bias_full_skips": dict(sq=64, sk=64, bias=(1, 2, 64, 64), segments=True, seed=4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_grads_match_reference(name):
    check(*make_case(**CASES[name]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(dtype):
    check(*make_case(hq=4, hkv=2, causal=True, softcap=4.0, dtype=dtype), dtype=dtype)


def test_default_blocks_single_tile():
    """Default (large) blocks clip to short sequences: one tile per row."""
    check(*make_case(sq=50, sk=90, causal=True), backend="pallas_gpu_interpret")


def test_empty_rows_are_zero_with_zero_grads():
    q, k, v, _, _ = make_case(sq=40, sk=72, hq=1)
    seg_q = jnp.asarray(np.r_[np.zeros(20), np.full(20, 7)][None].astype(np.int32))
    seg_k = jnp.zeros((1, 72), jnp.int32)  # queries with id 7 see nothing
    kw = dict(q_segment_ids=seg_q, kv_segment_ids=seg_k, backend=SMALL)
    (out, lse), vjp = jax.vjp(lambda q: flashport.attention(q, k, v, return_lse=True, **kw), q)
    assert np.all(np.asarray(out)[:, 20:] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :, 20:]))
    (dq,) = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
    assert np.all(np.isfinite(np.asarray(dq))) and np.all(np.asarray(dq)[:, 20:] == 0)


def test_lse_gradient():
    """A loss on the lse alone: its cotangent flows through the kernels' delta term."""
    q, k, v, _, _ = make_case(causal=True)

    def loss(q, k):
        return jnp.sum(flashport.attention(q, k, v, causal=True, backend=SMALL, return_lse=True)[1])

    dq, dk = jax.grad(loss, argnums=(0, 1))(q, k)
    # d lse_i / d s_ij = P_ij: the gradient of sum(lse) is the reference's with dO = 0 and a delta
    # of -1 per row; check it from the float64 probabilities directly.
    qf, kf = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k))
    kf = np.repeat(kf, 2, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", qf, kf) / np.sqrt(qf.shape[-1])
    sq, sk = s.shape[-2:]
    s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want_dq = np.einsum("bhqk,bhkd->bhqd", p, kf) / np.sqrt(qf.shape[-1])
    want_dk = np.einsum("bhqk,bhqd->bhkd", p, qf).reshape(1, 1, 2, sk, -1).sum(2) / np.sqrt(qf.shape[-1])
    assert_close(dq, want_dq.transpose(0, 2, 1, 3), 1e-4, "dq")
    assert_close(dk, want_dk.transpose(0, 2, 1, 3), 1e-4, "dk")


def test_segment_block_skipping_never_computes_other_documents():
    """Four packed documents aligned to the 16-wide blocks: a tile pairing two documents is skipped.
    Poisoning document 0's values (read by the forward and dQ kernels) and its rows' output cotangent
    (read by the dK/dV kernel) with NaN leaves the other documents finite and equal to the reference
    on clean inputs; a computed tile would turn them NaN (0 * NaN), as causal bounds alone visit
    document 0's blocks from every later query block."""
    q, k, v, d_out, _ = make_case(sq=64, sk=64, hq=2, hkv=1, seed=5)
    ids = jnp.asarray(np.arange(64)[None] // 16, jnp.int32)
    kw = dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    nan = float("nan")
    blocks16 = registry.use("pallas_gpu_interpret", block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
    out, vjp = jax.vjp(
        lambda q, k, v: flashport.attention(q, k, v, backend=blocks16, **kw), q, k, v.at[:, :16].set(nan)
    )
    dq, dk, dv = vjp(jnp.asarray(d_out).at[:, :16].set(nan))
    want_out, _ = reference_attention(q, k, v, **kw)
    want = reference_attention_vjp(q, k, v, d_out, **kw)
    assert_close(out[:, 16:], want_out[:, 16:], 2e-5, "out")
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3], strict=True):
        assert_close(got[:, 16:], ref[:, 16:], 1e-4, name)


def test_vmap_and_jit():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 1, 40, 2, 16)), jnp.float32)
    out = jax.jit(jax.vmap(lambda q: flashport.attention(q, q, q, causal=True, backend=SMALL)))(q)
    for i in range(2):
        assert_close(out[i], reference_attention(q[i], q[i], q[i], causal=True)[0], 2e-5, f"out[{i}]")


# ------------------------------------------------------------------------------ block skipping


def _visible_blocks(spec, bq, bk, every=False):
    """Brute force: the (query block, key block) pairs holding at least one visible pair, or with
    ``every`` the unpadded pairs whose every entry is visible (they need no position mask)."""
    i = np.arange(spec.seq_q)[:, None] + spec.offset
    j = np.arange(spec.seq_k)[None, :]
    keep = np.ones((spec.seq_q, spec.seq_k), bool)
    if spec.causal:
        keep &= j <= i
    if spec.window_left is not None:
        keep &= j >= i - spec.window_left
    if spec.window_right is not None:
        keep &= j <= i + spec.window_right
    nq, nk = -(-spec.seq_q // bq), -(-spec.seq_k // bk)
    if every:
        return {
            (a, c)
            for a in range(spec.seq_q // bq)
            for c in range(spec.seq_k // bk)
            if keep[a * bq : (a + 1) * bq, c * bk : (c + 1) * bk].all()
        }
    return {
        (a, c)
        for a in range(nq)
        for c in range(nk)
        if keep[a * bq : (a + 1) * bq, c * bk : (c + 1) * bk].any()
    }


@pytest.mark.parametrize(
    "spec",
    [
        band_spec(40, 72),
        band_spec(40, 72, causal=True),
        band_spec(72, 40, causal=True),
        band_spec(72, 40, causal=True, align="top_left"),
        band_spec(300, 300, causal=True, left=50),
        band_spec(100, 260, left=30, right=10),
        band_spec(260, 100, left=0, right=0),
        band_spec(1, 72, causal=True),
        band_spec(64, 64, left=5, right=None, align="top_left"),
    ],
    ids=lambda s: f"{s.seq_q}x{s.seq_k}_c{int(s.causal)}_w{s.window_left},{s.window_right}_o{s.offset}",
)
def test_loop_bounds_visit_exactly_the_visible_blocks(spec):
    """The kernels' traced loop bounds (forward/dQ over key blocks, dK/dV over query blocks) cover
    every tile with a visible pair and nothing else: block skipping is both safe and tight. The
    unmasked ranges hold exactly the unpadded tiles whose every entry is visible."""
    for bq, bk in ((16, 16), (32, 64), (64, 16)):
        g = Geometry.make(spec, bq, bk)
        for every, rows_fn, cols_fn in (
            (False, key_block_bounds, query_block_bounds),
            (True, full_key_blocks, full_query_blocks),
        ):
            want = _visible_blocks(spec, g.bq, g.bk, every=every)
            by_rows = set()
            for i in range(g.nq):
                lo, hi = (int(x) for x in rows_fn(g, jnp.int32(i)))
                by_rows |= {(i, j) for j in range(lo, hi)}
            by_cols = set()
            for j in range(g.nk):
                lo, hi = (int(x) for x in cols_fn(g, jnp.int32(j)))
                by_cols |= {(i, j) for i in range(lo, hi)}
            assert by_rows == want, (bq, bk, every)
            assert by_cols == want, (bq, bk, every)


# ------------------------------------------------------------------------------ options, registry, lowering


def test_bad_options_are_named():
    q, k, v, _, _ = make_case(sq=8, sk=8)
    with pytest.raises(ValueError, match=r"block_k must be a power of two >= 16.*got 48.*registry.use"):
        flashport.attention(q, k, v, backend=registry.use("pallas_gpu_interpret", block_k=48))
    with pytest.raises(ValueError, match=r"block_q_bwd must be a power of two >= 16.*got 8"):
        flashport.attention(q, k, v, backend=registry.use("pallas_gpu_interpret", block_q_bwd=8))
    with pytest.raises(ValueError, match=r"got unknown \['blockq'\]"):
        flashport.attention(q, k, v, backend=registry.use("pallas_gpu_interpret", blockq=64))
    with pytest.raises(ValueError, match=r"num_warps must be one of"):
        flashport.attention(q, k, v, backend=registry.use("pallas_gpu_interpret", num_warps=3))


def test_registry_entries():
    rows = flashport.backends()
    assert rows["pallas_gpu"]["platforms"] == ["cuda"]
    assert rows["pallas_gpu_interpret"]["platforms"] == ["cpu"]
    assert all(rows["pallas_gpu"]["features"].values()), "pallas_gpu serves every contract feature"
    assert rows["pallas_gpu"]["available"] == any(d.platform == "gpu" for d in jax.devices())
    assert "pallas_gpu_interpret" not in registry.AUTO_PREFERENCE["cpu"]


def test_auto_on_cuda_picks_pallas_gpu_where_cudnn_cannot():
    q, k, v, _, kw = make_case(causal=True, softcap=5.0, dtype="bfloat16")
    _, call = api.prepare(q, k, v, **kw)
    assert registry.choose("cuda", call)[0] == "pallas_gpu"
    _, call = api.prepare(q, k, v, causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    assert registry.choose("cuda", call)[0] == "pallas_gpu"
    big = jnp.zeros((1, 8, 1, 512), jnp.bfloat16)
    _, call = api.prepare(big, big, big)
    assert "head_dim 512" in registry.missing_features(registry.get("pallas_gpu"), call)[0]
    assert registry.choose("cuda", call)[0] != "pallas_gpu"


def _lower_for_cuda(dtype, bias_shape):
    b, sq, sk, hq, hkv, d = 2, 40, 72, 4, 2, 24
    q = jax.ShapeDtypeStruct((b, sq, hq, d), dtype)
    k = jax.ShapeDtypeStruct((b, sk, hkv, d), dtype)
    bias = jax.ShapeDtypeStruct(bias_shape, jnp.float32)
    mask = jax.ShapeDtypeStruct((1, hq, sq, sk), jnp.bool_)
    seg_q, seg_k = jax.ShapeDtypeStruct((b, sq), jnp.int32), jax.ShapeDtypeStruct((b, sk), jnp.int32)

    def loss(q, k, v, bias, mask, seg_q, seg_k):
        out, lse = flashport.attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            q_segment_ids=seg_q,
            kv_segment_ids=seg_k,
            causal=True,
            window=(20, None),
            softcap=3.0,
            dropout_rate=0.1,
            dropout_rng=jax.random.key(1),
            backend="pallas_gpu",
            return_lse=True,
        )
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return grad.trace(q, k, k, bias, mask, seg_q, seg_k).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize(
    "bias_shape", [(2, 4, 40, 72), (1, 1, 1, 72), (1, 4, 40, 1)], ids=["full", "keys", "rows"]
)
def test_lowers_for_cuda(dtype, bias_shape):
    """Forward, dK/dV and dQ kernels with every feature lower to Triton for CUDA on a CPU-only host."""
    text = _lower_for_cuda(dtype, bias_shape)
    assert text.count("__gpu$xla.gpu.triton") == 3
    for name in ("flashport_gpu_fwd", "flashport_gpu_dkv", "flashport_gpu_dq"):
        assert name in text


def test_exports_for_cuda():
    """``jax.export`` for platform cuda works on a CPU host once the Triton custom call (which has
    no cross-version compatibility guarantee) is explicitly allowed."""
    q = jax.ShapeDtypeStruct((1, 40, 2, 16), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True, backend="pallas_gpu"))
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(f, platforms=["cuda"])(q, q, q)
    exp = jax.export.export(
        f,
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, q, q)
    assert exp.platforms == ("cuda",)
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_auto_exports_for_cpu_and_cuda_and_runs_on_cpu():
    """One module for ``["cpu", "cuda"]``: the CUDA branch holds the Triton kernel (lowered for cuda
    only), the CPU branch still runs here and matches the reference."""
    q, k, v, _, _ = make_case(causal=True, softcap=3.0)
    f = jax.jit(lambda q, k, v: flashport.attention(q, k, v, causal=True, softcap=3.0))
    exp = jax.export.export(
        f,
        platforms=["cpu", "cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, k, v)
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1
    assert_close(exp.call(q, k, v), reference_attention(q, k, v, causal=True, softcap=3.0)[0], 2e-5, "out")


def test_gpu_check_script_gradient_check_runs_here():
    """benchmarks/gpu_check.py imports on CPU and its gradient check (the one the device run uses on
    the compiled kernels) passes with the interpreter twin on a small shape."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    case = [c for c in gpu_check.GRAD_CASES if c[0] == "key-padding bias + segments"]
    assert gpu_check.check_grads(
        "pallas_gpu_interpret", jnp.float32, sq=40, sk=72, d=16, tol=1e-4, cases=case
    )


def test_no_queries():
    """Sq == 0: empty out and lse, zero key/value gradients, no kernel launched."""
    q = jnp.zeros((1, 0, 2, 16), jnp.float32)
    k = jnp.ones((1, 8, 2, 16), jnp.float32)
    out, lse = flashport.attention(q, k, k, causal=True, backend=SMALL, return_lse=True)
    assert out.shape == (1, 0, 2, 16) and lse.shape == (1, 2, 0)
    dk = jax.grad(lambda k: flashport.attention(q, k, k, backend=SMALL).sum())(k)
    assert dk.shape == k.shape and not np.any(np.asarray(dk))
