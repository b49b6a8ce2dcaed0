"""The Pallas TPU kernels, run in the TPU interpreter on CPU, against the independent float64 reference.

Every case goes through ``flashport.attention(..., backend=pallas_tpu_interpret)`` with small blocks
(32 query rows x 128 keys) so that each spans several query and key blocks with ragged tails, and
checks the output, the lse and the gradients of q, k, v (and bias) against ``tests/reference.py``.

Tolerances (max abs error, relative to max(1, max|reference|)): float32 forward 2e-5 and gradients
1e-4; bfloat16 3e-2 / 6e-2; float16 4e-3 / 1e-2 (inputs are rounded to the dtype before the reference
sees them, so only the kernel's own arithmetic is measured).

The interpreter is slow (every grid step is a host round trip), so the default matrix is kept small;
``-m slow`` runs a wider one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reduce_to_shape, reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.backends import pallas_tpu
from flashport.kernels.backends.pallas_tpu.blocks import GENERATION_DEFAULTS, BlockSizes, resolve_blocks
from flashport.kernels.backends.pallas_tpu.classify import full_block_ranges
from flashport.kernels.backends.pallas_tpu.tiling import Geometry, analytic_causal_fraction, visited_count
from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import AttentionSpec

SMALL = registry.use("pallas_tpu_interpret", block_q=32, block_k=128)
TOL = {"float32": (2e-5, 1e-4), "bfloat16": (3e-2, 6e-2), "float16": (4e-3, 1e-2)}


def make_case(
    seed=0,
    b=1,
    sq=40,
    sk=200,
    hq=2,
    hkv=1,
    d=64,
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

    def run(q, k, v, bias):
        return flashport.attention(q, k, v, bias=bias, backend=backend, return_lse=True, **kwargs)

    ref_kwargs = dict(kwargs, bias=bias)
    want_out, want_lse = reference_attention(q, k, v, **ref_kwargs)
    if not grads:
        out, lse = run(q, k, v, bias)
    else:
        (out, lse), vjp = jax.vjp(run, q, k, v, bias)
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
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"d{name} has non-finite values"
        assert_close(g, w, grad_tol, f"d{name}")
    if bias is not None:
        assert_close(got[3], reduce_to_shape(want[3], bias.shape), grad_tol, "dbias")


# Each default case combines several features so the matrix stays small; together they cover every
# feature, both alignments with Sq < Sk and Sq > Sk, GQA ratios 1/2/4 (MHA, GQA, MQA), ragged
# lengths, head_dim 64/96/128/256, Sq = 1 and empty rows.
CASES = {
    "plain_mqa_ragged": dict(),
    "causal_br_gqa_dv64": dict(hq=4, hkv=2, causal=True, d=128, dv=64),
    "causal_tl_sq>sk_mha": dict(sq=100, sk=70, hq=2, hkv=2, causal=True, align="top_left", d=128),
    "causal_br_sq>sk_empty_rows": dict(sq=100, sk=70, hq=1, causal=True),
    "window_softcap_scale_d96": dict(window=(40, 10), softcap=2.5, scale=0.3, d=96),
    "window_left_tl_bias_full": dict(window=(50, None), align="top_left", bias=(1, 2, 40, 200)),
    "bias_bcast_mask_segments": dict(
        b=2, hq=1, sk=130, bias=(2, 1, 1, 130), mask=(1, 1, 40, 130), segments=True, causal=True
    ),
    "mask_empty_rows_d256": dict(sq=40, sk=130, mask=(1, 1, 40, 130), empty_rows=True, d=256),
    "decode_sq1": dict(sq=1, sk=200, hq=4, causal=True, bias=(1, 4, 1, 200)),
    "mask_per_head_gqa": dict(hq=4, hkv=2, mask=(1, 4, 40, 200)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_grads_match_reference(name):
    check(*make_case(**CASES[name]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(dtype):
    check(*make_case(hq=4, hkv=2, sk=130, causal=True, dtype=dtype), dtype=dtype)


def test_full_tiles_with_segments_and_gqa():
    """Tiles with one segment id on both sides below the diagonal run the mask-free bodies of all three
    kernels (e.g. query block 4 x key block 0: rows 128..159, keys 0..127, all in segment 0)."""
    q, k, v, d_out, kwargs = make_case(sq=256, sk=256, hq=4, hkv=2, causal=True)
    seg = jnp.asarray(np.r_[np.zeros(160), np.ones(96)][None].astype(np.int32))
    spec = _spec(256, 256, causal=True)
    lo, hi = full_block_ranges(Geometry.make(spec, 32, 128))
    assert lo[4] == 0 and hi[4] == 1
    check(q, k, v, d_out, dict(kwargs, q_segment_ids=seg, kv_segment_ids=seg))


def test_head_blocks_keep_each_heads_rows(monkeypatch):
    """The heads-major kernels serve several kv heads per grid step (``Geometry.head_block``). With a
    VMEM budget that holds two (dQ, dK/dV) or three (forward) of six kv heads (GQA 2: three or two
    steps along the heads, each kernel with its own head block), every query head must still read
    its own query rows, its own kv head's K/V, its own slice of a per-head bias and write its own
    output, lse, dQ and bias-gradient rows, and each kv head gather dK/dV from its own query heads:
    a mix-up of heads within or across steps changes the results."""
    from flashport.kernels.backends.pallas_tpu import backend as pb
    from flashport.kernels.backends.pallas_tpu.blocks import (
        MULTI_HEAD_VMEM,
        backward_vmem_bytes,
        forward_vmem_bytes,
    )

    hq, hkv, sq, sk = 12, 6, 70, 200
    # float32, D = 64 (padded to 128 lanes: heads-major), 32 x 128 tiles, a per-head f32 bias
    # (2 buffers per head; the dQ kernel also double-buffers its f32 gradient tile).
    fwd = forward_vmem_bytes(32, 128, 2 * 2, 128, 128, 4, 2, tile_bytes=2 * 4 * 4)
    dq = backward_vmem_bytes("dq", 32, 128, 2 * 2, 2, 128, 128, 4, tile_bytes=4 * 4 * 4)
    dkv = backward_vmem_bytes("dkv", 32, 128, 2 * 2, 2, 128, 128, 4, tile_bytes=2 * 4 * 4)
    budget = max(fwd, dq, dkv)
    monkeypatch.setitem(MULTI_HEAD_VMEM, "v6e", (budget, None))
    q, k, v, d_out, kwargs = make_case(sq=sq, sk=sk, hq=hq, hkv=hkv, causal=True, bias=(1, hq, sq, sk))
    _, blocks = resolve_blocks({"block_q": 32, "block_k": 128}, "pallas_tpu_interpret")
    canon = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
    cfg = pb.Config(_spec(sq, sk, causal=True), blocks, True, "v6e")
    heads_per_step = [
        cfg.geometry(kind, *canon, bias=kwargs["bias"]).head_block for kind in ("fwd", "dq", "dkv")
    ]
    assert heads_per_step == [3, 2, 2]  # the forward's smaller step holds 3 (2 steps), the backward's 2
    check(q, k, v, d_out, kwargs)


def test_head_block_is_a_divisor_of_the_kv_heads_that_fits():
    from flashport.kernels.backends.pallas_tpu.blocks import fit_head_block

    def fitted(kv_heads, fits):  # the budget holds ``fits`` kv heads' blocks and no more
        return fit_head_block(kv_heads, lambda hb: (hb, fits))

    assert fitted(6, 4) == 3  # 4 kv heads fit, but 4 does not divide 6
    assert fitted(6, 6) == 6
    assert fitted(7, 6) == 1  # prime: one kv head per step
    assert fitted(8, 8) == 8 and fitted(8, 7) == 4


def test_default_blocks_single_tile():
    """Default (large) blocks clip to short sequences: one tile per row (forward only)."""
    check(*make_case(sq=50, sk=90, causal=True), backend="pallas_tpu_interpret", grads=False)


def test_empty_rows_are_zero_with_zero_grads():
    q, k, v, _d_out, _ = make_case(sq=40, sk=130, hq=1)
    seg_q = jnp.asarray(np.r_[np.zeros(20), np.full(20, 7)][None].astype(np.int32))
    seg_k = jnp.zeros((1, 130), jnp.int32)  # queries with id 7 see nothing
    kw = dict(q_segment_ids=seg_q, kv_segment_ids=seg_k, backend=SMALL)
    (out, lse), vjp = jax.vjp(lambda q: flashport.attention(q, k, v, return_lse=True, **kw), q)
    assert np.all(np.asarray(out)[:, 20:] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :, 20:]))
    (dq,) = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
    assert np.all(np.isfinite(np.asarray(dq))) and np.all(np.asarray(dq)[:, 20:] == 0)


def test_vmap_and_jit():
    """vmap over an extra leading axis (the interpreter maps it; on TPU the kernel grid grows)."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 1, 40, 2, 64)), jnp.float32)
    out = jax.jit(jax.vmap(lambda q: flashport.attention(q, q, q, causal=True, backend=SMALL)))(q)
    for i in range(2):
        assert_close(out[i], reference_attention(q[i], q[i], q[i], causal=True)[0], 2e-5, f"out[{i}]")


# ------------------------------------------------------------------------------ block skipping


def _spec(sq, sk, **kw):
    return AttentionSpec(
        scale=1.0,
        causal=kw.get("causal", False),
        window_left=kw.get("left"),
        window_right=kw.get("right"),
        offset=sk - sq,
        softcap=None,
        seq_q=sq,
        seq_k=sk,
    )


def _tiles_with_visible_keys(spec, bq, bk, q_seg=None, kv_seg=None):
    """Brute force from the reference's own notion of visibility: tiles with >= 1 visible pair."""
    sq, sk = spec.seq_q, spec.seq_k
    i = np.arange(sq)[:, None] + spec.offset
    j = np.arange(sk)[None, :]
    keep = np.ones((sq, sk), bool)
    if spec.causal:
        keep &= j <= i
    if spec.window_left is not None:
        keep &= j >= i - spec.window_left
    keep = np.broadcast_to(keep, (1 if q_seg is None else q_seg.shape[0], sq, sk))
    if q_seg is not None:
        keep = keep & (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])
    nq, nk = -(-sq // bq), -(-sk // bk)
    return sum(
        bool(keep[b, a * bq : (a + 1) * bq, c * bk : (c + 1) * bk].any())
        for b in range(keep.shape[0])
        for a in range(nq)
        for c in range(nk)
    )


def test_causal_square_visits_n_plus_1_over_2n_blocks():
    """Instrumented interpreter run: the kernel's compute ran on exactly (n+1)/2n of the tiles."""
    n, block = 8, 128
    s = n * block
    q, k, v, _, _ = make_case(sq=s, sk=s, hq=1, d=128)
    spec = _spec(s, s, causal=True)
    out, _, visits = pallas_tpu.count_visited_tiles(
        jnp.swapaxes(q, 1, 2),
        jnp.swapaxes(k, 1, 2),
        jnp.swapaxes(v, 1, 2),
        spec=spec,
        options=dict(block_q=block, block_k=block),
    )
    visited = int(np.sum(visits))
    assert visited == n * (n + 1) // 2 == 36
    assert visited / (n * n) == pytest.approx(analytic_causal_fraction(n))  # 0.5625 for n = 8
    g = Geometry.make(spec, block, block)
    assert g.steps_k == n and g.visited_tiles == visited
    want, _ = reference_attention(q, k, v, causal=True, scale=1.0)
    assert_close(jnp.swapaxes(out, 1, 2), want, 2e-5, "out")


def test_window_and_segments_visit_only_overlapping_blocks():
    """Sliding windows shrink the grid; segment ids skip blocks whose id ranges do not overlap."""
    spec = _spec(1024, 1024, causal=True, left=200)
    g = Geometry.make(spec, 128, 128)
    assert g.steps_k == 3  # a 201-key window touches at most 3 key blocks of 128
    assert g.visited_tiles == _tiles_with_visible_keys(spec, 128, 128) == 21  # of 64
    sq = sk = 512
    rng = np.random.default_rng(0)
    q_seg = np.sort(rng.integers(0, 4, (2, sq)), axis=1).astype(np.int32)
    spec2 = _spec(sq, sk)
    g2 = Geometry.make(spec2, 128, 128)
    counted = visited_count(g2, jnp.asarray(q_seg), jnp.asarray(q_seg))
    assert counted == _tiles_with_visible_keys(spec2, 128, 128, q_seg, q_seg) < 2 * 4 * 4
    q, k, v, _, _ = make_case(b=2, sq=sq, sk=sk, hq=1, d=128)
    canon = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
    _, _, visits = pallas_tpu.count_visited_tiles(
        *canon,
        spec=spec2,
        options=dict(block_q=128, block_k=128),
        q_seg=jnp.asarray(q_seg),
        kv_seg=jnp.asarray(q_seg),
    )
    assert int(np.sum(visits)) == counted


# ------------------------------------------------------------------------------ options, registry


def test_bad_block_option_is_named_before_lowering():
    q, k, v, _, _ = make_case(sq=8, sk=8)
    with pytest.raises(ValueError, match=r"block_k=100 .*multiple of 128.*registry.use"):
        flashport.attention(q, k, v, backend=registry.use("pallas_tpu_interpret", block_k=100))
    with pytest.raises(ValueError, match=r"block_q_dq=0"):
        flashport.attention(q, k, v, backend=registry.use("pallas_tpu_interpret", block_q_dq=0))
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['blockq'\]"):
        flashport.attention(q, k, v, backend=registry.use("pallas_tpu_interpret", blockq=64))
    with pytest.raises(ValueError, match=r"generation='v9'"):
        flashport.attention(q, k, v, backend=registry.use("pallas_tpu_interpret", generation="v9"))


def test_block_defaults_per_generation():
    for gen, blocks in GENERATION_DEFAULTS.items():
        blocks.validate()
        assert resolve_blocks({"generation": gen}, "pallas_tpu") == (gen, blocks)
        assert min(blocks.block_q, blocks.block_k) >= 256, "128-blocks are known to be far too slow"
    assert all(getattr(GENERATION_DEFAULTS["v6e"], f) % 256 == 0 for f in BlockSizes.__dataclass_fields__)
    _, b = resolve_blocks({"block_q": 256}, "pallas_tpu")
    assert b.block_q == b.block_q_dkv == b.block_q_dq == 256


def _has_fully_visible_tile(sq: int, window: int, bq: int, bk: int) -> bool:
    i, j = np.arange(sq)[:, None], np.arange(sq)[None, :]
    visible = (j <= i) & (j >= i - window)
    tiles = visible.reshape(sq // bq, bq, sq // bk, bk).all(axis=(1, 3))
    return bool(tiles.any())


def test_band_fits_default_blocks():
    """A sliding window narrower than the default tiles leaves every visited tile masked; the default
    blocks are halved (not below 512) until whole tiles fit in the band. A causal dQ kernel over at
    most two tall query blocks gets square tiles. Blocks the user set stay."""
    from flashport.kernels.backends.pallas_tpu.backend import Config

    s, window = 2048, 1024
    spec = _spec(s, s, causal=True, left=window)
    q = jnp.zeros((1, 8, s, 128), jnp.bfloat16)
    v6e = GENERATION_DEFAULTS["v6e"]
    assert not _has_fully_visible_tile(s, window, v6e.block_q, v6e.block_k)
    narrowed = {
        kind: Config(spec, v6e, False, "v6e").geometry(kind, q, q, q) for kind in ("fwd", "dkv", "dq")
    }
    assert {(g.bq, g.bk) for g in narrowed.values()} == {(512, 512)}
    assert _has_fully_visible_tile(s, window, 512, 512)
    wide = Config(_spec(s, s, causal=True, left=4096), v6e, False, "v6e").geometry("fwd", q, q, q)
    assert (wide.bq, wide.bk) == (v6e.block_q, v6e.block_k)
    narrow = Config(_spec(s, s, causal=True, left=100), v6e, False, "v6e").geometry("dkv", q, q, q)
    assert (narrow.bq, narrow.bk) == (512, 512)
    causal = Config(_spec(s, s, causal=True), v6e, False, "v6e")
    assert (causal.geometry("dq", q, q, q).bq, causal.geometry("fwd", q, q, q).bq) == (512, 1024)
    long_q = jnp.zeros((1, 8, 4 * s, 128), jnp.bfloat16)
    causal_long = Config(_spec(4 * s, 4 * s, causal=True), v6e, False, "v6e").geometry("dq", *[long_q] * 3)
    assert causal_long.bq == v6e.block_q_dq
    v5e = GENERATION_DEFAULTS["v5e"]
    for mask, want in ((dict(causal=True), (512, 512)), ({}, (v5e.block_q_dkv, v5e.block_k_dkv))):
        dkv = Config(_spec(s, s, **mask), v5e, False, "v5e").geometry("dkv", q, q, q)
        assert (dkv.bq, dkv.bk) == want
    _, user = resolve_blocks({"generation": "v6e", "block_q": 1024, "block_k": 512}, "pallas_tpu")
    kept = Config(spec, user, False, "v6e").geometry("fwd", q, q, q)
    assert (kept.bq, kept.bk) == (1024, 512)


def test_registry_and_auto_on_cpu():
    rows = flashport.backends() if hasattr(flashport, "backends") else registry.backends()
    assert rows["pallas_tpu"]["platforms"] == ["tpu"] and all(rows["pallas_tpu"]["features"].values())
    assert rows["pallas_tpu_interpret"]["platforms"] == ["cpu"]
    assert "pallas_tpu_interpret" not in registry.AUTO_PREFERENCE["cpu"]
    assert registry.AUTO_PREFERENCE["tpu"][0] == "pallas_tpu"


def test_cost_estimate_is_analytic():
    """The forward pallas_call carries a CostEstimate counting only the tiles it visits."""
    s, d = 512, 128
    q = jnp.zeros((1, 2, s, d), jnp.bfloat16)
    spec = _spec(s, s, causal=True)
    fn = registry.get("pallas_tpu").fn
    jaxpr = jax.make_jaxpr(
        lambda q: fn(q, q, q, None, None, None, None, None, spec=spec, options=dict(block_q=128, block_k=128))
    )(q)
    # The TPU lowering and its interpreter fallback (backends.pallas_platform) carry the same kernel.
    costs = {e.params["cost_estimate"] for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"}
    assert len(costs) == 1
    costs = list(costs)
    tiles = 2 * 10  # 2 heads x (4*5/2) causal tiles
    assert costs[0].flops == tiles * 4 * 128 * 128 * d
    assert costs[0].transcendentals == tiles * 128 * 128
    assert costs[0].bytes_accessed > 0


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.core.subjaxprs(e) if hasattr(jax.core, "subjaxprs") else ():
            yield from _eqns(sub)
        for p in e.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield from _eqns(inner)
            elif hasattr(p, "eqns"):
                yield from _eqns(p)


# ------------------------------------------------------------------------------ wider matrix


SLOW = {
    f"{feat}_{dt}_{hq}x{hkv}_d{d}_{sq}x{sk}": (dict(hq=hq, hkv=hkv, d=d, sq=sq, sk=sk, dtype=dt, **extra), dt)
    for feat, extra in {
        "causal_br": dict(causal=True),
        "causal_tl": dict(causal=True, align="top_left"),
        "window": dict(window=(33, 17)),
        "softcap_bias": dict(softcap=1.5, bias=(1, 1, 1, 1)),
        "segments_mask": dict(segments=True, mask=(1, 1, 1, 1), b=1),
    }.items()
    for dt in ("float32", "bfloat16")
    for hq, hkv in ((4, 4), (4, 1))
    for d in (64, 128)
    for sq, sk in ((97, 260), (260, 97))
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_wide_matrix(name):
    case, dtype = SLOW[name]
    case = dict(case)
    if case.get("bias") == (1, 1, 1, 1):
        case["bias"] = (1, case["hq"], case["sq"], case["sk"])
    if case.get("mask") == (1, 1, 1, 1):
        case["mask"] = (1, 1, 1, case["sk"])
    check(*make_case(**case), dtype=dtype)
