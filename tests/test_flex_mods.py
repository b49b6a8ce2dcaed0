"""``score_mod`` / ``mask_mod`` (FlexAttention's user functions) against the float64 reference.

Every case is a JAX mod that closes over arrays and its numpy twin over whole score matrices
(:func:`reference.reference_attention`'s ``score_mod`` / ``mask_mod``): outputs, lse and the
gradients w.r.t. q, k, v and the closed-over arrays (summed by hand from the reference's gradient
w.r.t. the score_mod's output) must agree on every backend that serves mods.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_attention, reference_mod_vjp

import flashport
from flashport.kernels.backends.pallas_tpu import backend as pallas_tpu_backend
from flashport.kernels.contract import validate
from flashport.kernels.contract.registry import use
from flashport.kernels.contract.spec import make_spec
from flashport.kernels.semantics import block_mask as block_mask_lib
from flashport.kernels.semantics import mods as mods_lib

BACKENDS = {
    "xla": "xla",
    "blockwise": use("blockwise", block_q=8, block_k=16),
    "pallas_tpu": "pallas_tpu_interpret",
    "pallas_gpu": use("pallas_gpu_interpret", block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16),
}
# The default tier: every case on xla, a few on the tiled backends; the rest is @slow.
FAST = {
    "xla": None,
    "blockwise": {"alibi", "documents", "cross_bottom_right", "empty_rows"},
    "pallas_tpu": {"alibi", "relative_bias"},
    "pallas_gpu": {"documents"},
}


def _tier(backend, name):
    """pytest params: the (case, backend) pair, @slow unless in :data:`FAST`."""
    fast = FAST[backend] is None or name in FAST[backend]
    return pytest.param(name, backend, marks=() if fast else pytest.mark.slow, id=f"{name}-{backend}")


RTOL = 2e-5
ATOL = 2e-5


@dataclasses.dataclass
class Case:
    """One mod scenario: ``make(params) -> attention keywords`` (JAX), ``ref(params) -> reference
    keywords`` (numpy), the closed-over arrays and ``grads(d_scores, params) -> expected grads``."""

    make: Callable
    ref: Callable
    params: dict
    grads: Callable | None = None
    options: dict = dataclasses.field(default_factory=dict)
    shape: tuple = (2, 24, 24, 4, 4, 8)  # B, Sq, Sk, Hq, Hkv, D


def _alibi():
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    return Case(
        make=lambda p: {"score_mod": lambda s, b, h, i, j: s + p["slopes"][h] * (j - i)},
        ref=lambda p: {"score_mod": lambda s, b, h, i, j: s + p["slopes"][h] * (j - i)},
        params={"slopes": slopes},
        grads=lambda d, p: {
            "slopes": np.einsum("bhij,ij->h", d, np.arange(d.shape[3]) - np.arange(d.shape[2])[:, None])
        },
        options={"causal": True},
    )


def _relative_bias(radius=5):
    table = np.random.default_rng(3).standard_normal((4, 2 * radius + 1)).astype(np.float32)

    def bucket(i, j, xp):
        return xp.clip(i - j, -radius, radius) + radius

    def grads(d, p):
        sq, sk = d.shape[2:]
        buckets = bucket(np.arange(sq)[:, None], np.arange(sk)[None, :], np)
        out = np.zeros_like(p["table"], np.float64)
        for r in range(2 * radius + 1):
            out[:, r] = np.einsum("bhij,ij->h", d, (buckets == r).astype(np.float64))
        return {"table": out}

    return Case(
        make=lambda p: {"score_mod": lambda s, b, h, i, j: s + p["table"][h, bucket(i, j, jnp)]},
        ref=lambda p: {"score_mod": lambda s, b, h, i, j: s + p["table"][h, bucket(i, j, np)]},
        params={"table": table},
        grads=grads,
    )


def _documents():
    docs = np.array([[0] * 5 + [1] * 11 + [2] * 8, [0] * 12 + [1] * 12], np.int32)
    ids = jnp.asarray(docs)
    return Case(
        make=lambda p: {"mask_mod": lambda b, h, i, j: (ids[b, i] == ids[b, j]) & (j <= i)},
        ref=lambda p: {
            "mask_mod": lambda b, h, i, j: (
                (docs[b[..., 0, 0]][..., :, None] == docs[b[..., 0, 0]][..., None, :]) & (j <= i)
            )
        },
        params={},
    )


def _prefix_lm():
    prefix = np.array([6, 13], np.int32)
    return Case(
        make=lambda p: {"mask_mod": lambda b, h, i, j: (j <= i) | (j < jnp.asarray(prefix)[b])},
        ref=lambda p: {"mask_mod": lambda b, h, i, j: (j <= i) | (j < prefix[b])},
        params={},
    )


def _sliding_window():
    return Case(
        make=lambda p: {"mask_mod": lambda b, h, i, j: jnp.abs(i - j) <= 3},
        ref=lambda p: {"mask_mod": lambda b, h, i, j: np.abs(i - j) <= 3},
        params={},
    )


def _softcap():
    return Case(
        make=lambda p: {"score_mod": lambda s, b, h, i, j: 2.0 * jnp.tanh(s / 2.0)},
        ref=lambda p: {"score_mod": lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0)},
        params={},
        options={"scale": 1.5},
    )


def _gqa_alibi_window():
    case = _alibi()
    case.shape = (1, 20, 20, 4, 2, 8)
    case.options = {"window": (4, 2)}
    return case


def _cross_lengths(align):
    case = _relative_bias()
    case.shape = (1, 12, 28, 4, 2, 8)
    case.options = {"causal": True, "align": align}
    return case


def _empty_rows():
    """A mask_mod that hides every key of some query rows: those give 0, lse -inf, zero grads."""
    case = _alibi()
    case.make = lambda p, base=case.make: {**base(p), "mask_mod": lambda b, h, i, j: (i % 5 != 2) & (j <= i)}
    case.ref = lambda p, base=case.ref: {**base(p), "mask_mod": lambda b, h, i, j: (i % 5 != 2) & (j <= i)}
    case.options = {}
    return case


CASES = {
    "alibi": _alibi,
    "relative_bias": _relative_bias,
    "documents": _documents,
    "prefix_lm": _prefix_lm,
    "sliding_window": _sliding_window,
    "softcap": _softcap,
    "gqa_alibi_window": _gqa_alibi_window,
    "cross_bottom_right": lambda: _cross_lengths("bottom_right"),
    "cross_top_left": lambda: _cross_lengths("top_left"),
    "empty_rows": _empty_rows,
}


def _inputs(shape, seed=0):
    b, sq, sk, hq, hkv, d = shape
    r = np.random.default_rng(seed)
    q = r.standard_normal((b, sq, hq, d)).astype(np.float32)
    k = r.standard_normal((b, sk, hkv, d)).astype(np.float32)
    v = r.standard_normal((b, sk, hkv, d)).astype(np.float32)
    d_out = r.standard_normal((b, sq, hq, d)).astype(np.float32)
    d_lse = r.standard_normal((b, hq, sq)).astype(np.float32)
    return q, k, v, d_out, d_lse


def _check(case, backend, extra=None, ref_extra=None, attend=flashport.attention):
    q, k, v, d_out, d_lse = _inputs(case.shape)
    extra, ref_extra = extra or {}, ref_extra or {}

    def loss(q, k, v, params):
        out, lse = attend(
            q, k, v, backend=backend, return_lse=True, **case.make(params), **case.options, **extra
        )
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse), (out, lse)

    params = {n: jnp.asarray(x) for n, x in case.params.items()}
    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, params)
    options = {**case.ref(case.params), **case.options, **ref_extra}
    want_out, want_lse = reference_attention(q, k, v, **options)
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=RTOL, atol=ATOL)
    d_lse_ref = np.where(finite, d_lse, 0.0)
    *want, _dbias, d_scores = reference_mod_vjp(q, k, v, d_out, d_lse=d_lse_ref, **options)
    for got, ref in zip(grads[:3], want[:3], strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    if case.grads is not None:
        for name, ref in case.grads(d_scores, case.params).items():
            np.testing.assert_allclose(grads[3][name], ref, rtol=1e-4, atol=1e-4)
    return out, lse


@pytest.mark.parametrize(("name", "backend"), [_tier(b, n) for b in BACKENDS for n in CASES])
def test_mods_match_reference(name, backend):
    out, lse = _check(CASES[name](), BACKENDS[backend])
    if name == "empty_rows":
        assert np.all(np.asarray(out)[:, 2::5] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :, 2::5]))


@pytest.mark.parametrize(
    "backend", ["xla", *(pytest.param(b, marks=pytest.mark.slow) for b in list(BACKENDS)[1:])]
)
def test_mask_mod_with_segment_ids_and_dropout(backend):
    case = _alibi()
    segments = np.array([[0] * 10 + [1] * 14, [0] * 20 + [1] * 4], np.int32)
    seed = 7
    extra = {
        "q_segment_ids": segments,
        "kv_segment_ids": segments,
        "mask_mod": lambda b, h, i, j: (i - j) % 3 != 1,
        "dropout_rate": 0.25,
        "dropout_rng": jax.random.key(seed),
    }
    ref_extra = {
        "q_segment_ids": segments,
        "kv_segment_ids": segments,
        "mask_mod": lambda b, h, i, j: (i - j) % 3 != 1,
        "dropout_rate": 0.25,
        "dropout_seed": (0, seed),
    }
    _check(case, BACKENDS[backend], extra, ref_extra)


@pytest.mark.parametrize(
    "backend", ["xla", *(pytest.param(b, marks=pytest.mark.slow) for b in list(BACKENDS)[1:])]
)
def test_same_feature_as_mod_gives_the_same_result(backend):
    """softcap as tanh, a window as a mask_mod, ALiBi as a score_mod vs ``bias=``."""
    q, k, v, _, _ = _inputs((2, 24, 24, 4, 4, 8))
    run = lambda **kw: flashport.attention(q, k, v, backend=BACKENDS[backend], return_lse=True, **kw)  # noqa: E731
    pairs = [
        ({"softcap": 3.0}, {"score_mod": lambda s, b, h, i, j: 3.0 * jnp.tanh(s / 3.0)}),
        ({"window": (3, 1)}, {"mask_mod": lambda b, h, i, j: (j >= i - 3) & (j <= i + 1)}),
    ]
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
    pos = jnp.arange(24)
    alibi = slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None])
    pairs.append(
        (
            {"bias": alibi[None], "causal": True},
            {"score_mod": lambda s, b, h, i, j: s + slopes[h] * (j - i), "causal": True},
        )
    )
    for builtin, mod in pairs:
        for got, want in zip(run(**mod), run(**builtin), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_block_mask_classes_match_numpy():
    """Each tile's class follows from the mask it covers: empty, full or partial."""
    docs = np.array([0] * 50 + [1] * 30 + [2] * 20)
    ids = jnp.asarray(docs)
    mask_mod = lambda b, h, i, j: (ids[i] == ids[j]) & (j <= i)  # noqa: E731
    bm = flashport.block_mask(mask_mod, None, None, 100, 100, BLOCK_SIZE=16)
    dense = (docs[:, None] == docs[None, :]) & (np.arange(100)[None, :] <= np.arange(100)[:, None])
    n = -(-100 // 16)
    want = np.zeros((n, n), np.int8)
    for a in range(n):
        for c in range(n):
            tile = dense[a * 16 : (a + 1) * 16, c * 16 : (c + 1) * 16]
            want[a, c] = 2 if tile.all() else (1 if tile.any() else 0)
    np.testing.assert_array_equal(bm.classes[0, 0], want)
    # Regrouped for other tiles: the same rule at the new tile size.
    got = block_mask_lib.tile_classes(bm, 32, 48, per_head=False)
    for a in range(got.shape[0]):
        for c in range(got.shape[1]):
            tile = dense[a * 32 : (a + 1) * 32, c * 48 : (c + 1) * 48]
            assert got[a, c] == (2 if tile.all() else (1 if tile.any() else 0)), (a, c)
    assert bm.sparsity() == pytest.approx(100.0 * np.mean(want == 0))


def test_block_mask_refuses_a_broadcast_index_it_reads():
    with pytest.raises(ValueError, match="reads the batch index"):
        flashport.block_mask(lambda b, h, i, j: b == 0, None, 2, 8, 8)
    with pytest.raises(TypeError, match="must return a bool"):
        flashport.block_mask(lambda b, h, i, j: i - j, None, None, 8, 8)


def test_explicit_block_mask_jit_vmap_and_cache():
    """A block mask built once (also under jit from traced ids) serves many calls; a bare mask_mod
    builds one per shape and values and reuses it; vmap over the closed-over arrays works."""
    q, k, v, _, _ = _inputs((1, 40, 40, 2, 2, 8))
    docs = jnp.array([0] * 15 + [1] * 25)
    blockwise = use("blockwise", block_q=8, block_k=8)
    want = reference_attention(q, k, v, mask=np.asarray(docs[:, None] == docs[None, :]))[0]

    @jax.jit
    def run(q, docs):
        mask_mod = lambda b, h, i, j: docs[i] == docs[j]  # noqa: E731
        bm = flashport.block_mask(mask_mod, None, None, 40, 40, BLOCK_SIZE=8)
        return flashport.attention(q, k, v, block_mask=bm, backend=blockwise)

    np.testing.assert_allclose(run(q, docs), want, rtol=RTOL, atol=ATOL)
    mask_mod = lambda b, h, i, j: docs[i] == docs[j]  # noqa: E731
    first = block_mask_lib.cached_block_mask(*mods_lib.trace(mask_mod, "mask_mod"), 1, 2, 40, 40)
    again = block_mask_lib.cached_block_mask(*mods_lib.trace(mask_mod, "mask_mod"), 1, 2, 40, 40)
    assert first is again
    fresh = lambda b, h, i, j: (docs[i] == docs[j]) & (j >= 0)  # noqa: E731  (not cached yet)
    for _ in range(2):  # a block mask built and cached inside one jit trace serves the next trace
        traced_once = jax.jit(lambda q: flashport.attention(q, k, v, mask_mod=fresh, backend=blockwise))
        np.testing.assert_allclose(traced_once(q), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        flashport.attention(q, k, v, mask_mod=mask_mod, backend=blockwise), want, rtol=RTOL, atol=ATOL
    )

    slopes = jnp.array([[0.5, 0.1], [0.2, 0.3], [0.0, 1.0]])

    def alibi(sl):
        return flashport.attention(
            q, k, v, score_mod=lambda s, b, h, i, j: s + sl[h] * (j - i), backend=blockwise
        )

    batched = jax.vmap(alibi)(slopes)
    for n in range(3):
        np.testing.assert_allclose(batched[n], alibi(slopes[n]), rtol=1e-6, atol=1e-6)


def _tile_classes(dense, bq, bk):
    """Each [bq, bk] tile of the boolean ``dense`` [Sq, Sk] mask: 0 empty, 1 partial, 2 full."""
    nq, nk = -(-dense.shape[0] // bq), -(-dense.shape[1] // bk)
    out = np.zeros((nq, nk), np.int8)
    for a in range(nq):
        for c in range(nk):
            tile = dense[a * bq : (a + 1) * bq, c * bk : (c + 1) * bk]
            out[a, c] = 2 if tile.all() else (1 if tile.any() else 0)
    return out


@pytest.mark.parametrize(
    "backend",
    [use("blockwise", block_q=16, block_k=16), use("pallas_gpu_interpret", block_q=16, block_k=16)],
    ids=["blockwise", "pallas_gpu"],
)
def test_empty_tiles_are_skipped(backend):
    """The score_mod runs only on tiles the block mask does not mark empty, the mask_mod only on the
    ones it marks partial: counted with callbacks, next to the classes of the dense mask."""
    docs_np = np.array([0] * 16 + [1] * 20 + [2] * 12 + [3] * 16)
    docs = jnp.asarray(docs_np)
    scored, masked = set(), set()

    def score_mod(s, b, h, i, j):
        jax.debug.callback(lambda i, j: scored.add((int(i) // 16, int(j) // 16)), i, j)
        return s

    def mask_mod(b, h, i, j):
        jax.debug.callback(lambda i, j: masked.add((int(i) // 16, int(j) // 16)), i, j)
        return docs[i] == docs[j]

    bm = flashport.block_mask(mask_mod, None, None, 64, 64, BLOCK_SIZE=16)
    masked.clear()  # the block mask evaluated the mask_mod everywhere; the kernel's calls count
    q, k, v, _, _ = _inputs((1, 64, 64, 1, 1, 8))
    out = flashport.attention(q, k, v, score_mod=score_mod, block_mask=bm, backend=backend)
    dense = docs_np[:, None] == docs_np[None, :]
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask=dense)[0], rtol=RTOL, atol=ATOL)
    classes = _tile_classes(dense, 16, 16)
    assert scored == {tuple(t) for t in np.argwhere(classes != 0)}
    assert masked == {tuple(t) for t in np.argwhere(classes == 1)}


def test_pallas_tpu_tiles_follow_the_mask_mods_block_mask():
    """Pallas TPU forward with per-batch document masks: per query block, the tiles computed through
    the mask-free body are the block mask's FULL ones, those through the masked body its PARTIAL
    ones, and its EMPTY ones are skipped; the output is the reference's."""
    docs_np = np.array([[0] * 128 + [1] * 172 + [2] * 212, [0] * 300 + [1] * 212])
    docs = jnp.asarray(docs_np)
    q, k, v, _, _ = _inputs((2, 512, 512, 4, 2, 32))
    q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    mods = validate.prepare_mods(q, k, None, lambda b, h, i, j: docs[b, i] == docs[b, j], None, "BHSD")
    spec = make_spec(
        q.shape, k.shape, scale=None, causal=False, window=None, align="bottom_right", softcap=None
    )
    out, _, full, partial = pallas_tpu_backend.count_tiles_by_class(
        q, k, v, spec=spec, options=dict(block_q=128, block_k=128), mods=mods
    )
    dense = docs_np[:, :, None] == docs_np[:, None, :]
    want = reference_attention(q, k, v, layout="BHSD", mask=dense[:, None])[0]
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    group = 2  # query heads per kv head: each head tile counts once
    for b in range(2):
        classes = _tile_classes(dense[b], 128, 128)
        for hk in range(2):
            np.testing.assert_array_equal(np.asarray(full)[b, hk], group * np.sum(classes == 2, axis=1))
            np.testing.assert_array_equal(np.asarray(partial)[b, hk], group * np.sum(classes == 1, axis=1))
    assert np.sum(_tile_classes(dense[0], 128, 128) == 0) > 0  # the case skips tiles at all


def test_refusals_name_the_feature():
    q, k, v, _, _ = _inputs((1, 8, 8, 2, 2, 8))
    with pytest.raises(ValueError, match="score_mod"):
        flashport.attention(q, k, v, score_mod=lambda s, b, h, i, j: s, backend="cudnn")
    with pytest.raises(TypeError, match="score_mod must return a float"):
        flashport.attention(q, k, v, score_mod=lambda s, b, h, i, j: s > 0, backend="xla")
    bm = flashport.block_mask(lambda b, h, i, j: j <= i, None, None, 8, 16)
    with pytest.raises(ValueError, match="block_mask was built"):
        flashport.attention(q, k, v, block_mask=bm, backend="xla")


def test_one_shard_ring_runs_mods_like_the_reference():
    """ring_attention with mods (tests/ring_check.py runs them on 8 devices): on a one-device ring
    the mods see the same indices as the contract; a backend without mods refuses naming them."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    case, alibi = _documents(), _alibi()
    case.make = lambda p, base=case.make: {**base(p), **alibi.make(p)}
    case.ref = lambda p, base=case.ref: {**base(p), **alibi.ref(p)}
    case.params, case.grads = alibi.params, alibi.grads
    ring = functools.partial(flashport.ring_attention, mesh=mesh, axis_name="seq")
    _check(case, "xla", attend=ring)
    q, k, v, _, _ = _inputs((1, 8, 8, 2, 2, 8))
    with pytest.raises(ValueError, match="score_mod"):
        ring(q, k, v, score_mod=lambda s, b, h, i, j: s, backend="cudnn")


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_mods_under_x64_read_int32_indices(backend):
    """Under jax_enable_x64 the backends' index grids are int64; a mod traced on int32 indices (with
    Python-int arithmetic on them, as in ``ids[i + 8]``) still runs and matches the reference."""
    docs = np.array([0] * 14 + [1] * 18, np.int32)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    ref = dict(
        score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i),
        mask_mod=lambda b, h, i, j: docs[i + 8] == docs[j],
    )
    with jax.enable_x64(True):
        q, k, v, _, _ = _inputs((1, 24, 32, 4, 4, 8))
        ids, sl = jnp.asarray(docs), jnp.asarray(slopes)
        got = flashport.attention(
            q,
            k,
            v,
            score_mod=lambda s, b, h, i, j: s + sl[h] * (j - i),
            mask_mod=lambda b, h, i, j: ids[i + 8] == ids[j],
            backend=BACKENDS[backend],
        )
    want, _ = reference_attention(q, k, v, **ref)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=RTOL, atol=ATOL)


_DOCS = np.repeat(np.arange(4), [50, 130, 60, 80])  # 320 positions, uneven documents
_FINE_MASKS = {
    "causal": lambda xp: lambda b, h, i, j: j <= i,
    "window": lambda xp: lambda b, h, i, j: (j <= i) & (j >= i - 70),
    "documents": lambda xp: lambda b, h, i, j: xp.asarray(_DOCS)[i] == xp.asarray(_DOCS)[j],
}


@pytest.mark.parametrize(
    "blocks, mask, builtin",
    [((32, 128), mask, {}) for mask in sorted(_FINE_MASKS)]
    + [
        ((32, 96), mask, builtin)
        for mask in sorted(_FINE_MASKS)
        for builtin in ({}, {"causal": True}, {"causal": True, "bias": True})
    ],
)
def test_blockwise_partial_tiles_run_as_fine_sub_tiles(blocks, mask, builtin):
    """blockwise with key blocks a multiple of the query blocks: a mask_mod's partial coarse tiles run
    as fine sub-tiles by their own classes and the loops span only non-empty tiles (96: the last
    coarse block's padding holds fine blocks past the keys); with and without built-in masks and a
    bias (the split backward). out and the q, k, v gradients against the float64 reference."""
    rng = np.random.default_rng(7)
    s, h, d = 320, 2, 16
    q, k, v, g = (rng.standard_normal((1, s, h, d)) for _ in range(4))
    extra = dict(builtin)
    if extra.pop("bias", False):
        extra["bias"] = rng.standard_normal((1, h, s, s))
    score_mod = lambda sc, b, hh, i, j: sc + 0.01 * (j - i)  # noqa: E731
    bm = flashport.block_mask(_FINE_MASKS[mask](jnp), None, None, s, s, BLOCK_SIZE=32)
    backend = use("blockwise", block_q=blocks[0], block_k=blocks[1])
    jx = {n: jnp.asarray(a, jnp.float32) if n == "bias" else a for n, a in extra.items()}

    def f(q, k, v):
        return flashport.attention(q, k, v, backend=backend, block_mask=bm, score_mod=score_mod, **jx)

    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    out = f(*args)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * jnp.asarray(g, jnp.float32)), argnums=(0, 1, 2))(*args)
    ref = dict(mask_mod=_FINE_MASKS[mask](np), score_mod=score_mod, **extra)
    want, _ = reference_attention(q, k, v, **ref)
    want_grads = reference_mod_vjp(q, k, v, g, **ref)[:3]
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    for got, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), w, atol=1e-4)
