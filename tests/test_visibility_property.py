"""Property tests: every implementation of the contract's masking sees exactly the keys the
independent float64 reference (``tests/reference.py``) says it may.

Random Sq, Sk, causal, align, window, segment ids (and block sizes, kv-cache lengths, packed
sequences) are drawn by hypothesis. Each implementation is observed from the outside: with all-zero
queries every visible key gets the same weight, and with ``value`` = the identity over key
positions the output row of query i is ``1/count`` at its visible keys and 0 elsewhere, so the
output *is* the visibility matrix. Block tables are checked tile by tile: a tile a table skips holds
no visible pair, a tile it marks full is unpadded and entirely visible (and the tables are tight).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import _visible

import flashport
from flashport.kernels.backends.blockwise import _Tiling
from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import make_spec
from flashport.kernels.semantics import block_ranges
from flashport.kernels.semantics.visibility import band_visible

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@st.composite
def calls(draw, max_len=20, segments=True):
    """Keyword sets of one call: sq, sk and the contract's masking keywords."""
    sq = draw(st.integers(1, max_len))
    sk = draw(st.integers(1, max_len))
    side = st.one_of(st.none(), st.integers(0, max_len))
    window = draw(st.one_of(st.none(), st.tuples(side, side)))
    kw = dict(
        sq=sq, sk=sk, causal=draw(st.booleans()), align=draw(st.sampled_from(["bottom_right", "top_left"]))
    )
    kw["window"] = window
    if segments and draw(st.booleans()):
        # Sorted ids (packed documents) or arbitrary ones: both are the contract's "same id" rule.
        q_ids = sorted(draw(st.lists(st.integers(0, 2), min_size=sq, max_size=sq)))
        kv_ids = draw(st.lists(st.integers(0, 2), min_size=sk, max_size=sk))
        kw["q_segment_ids"], kw["kv_segment_ids"] = np.array([q_ids]), np.array([kv_ids])
    return kw


def _want(kw):
    """The reference's visibility [Sq, Sk] (batch 1, one head)."""
    return _visible(
        (1, 1, kw["sq"], 1),
        (1, 1, kw["sk"], 1),
        kw["causal"],
        kw["window"],
        kw["align"],
        None,
        kw.get("q_segment_ids"),
        kw.get("kv_segment_ids"),
    )[0, 0]


def _spec(kw):
    """The normalized spec of a drawn call (no scale or softcap: they do not affect visibility)."""
    options = {n: kw[n] for n in ("causal", "window", "align")}
    return make_spec((1, 1, kw["sq"], 1), (1, 1, kw["sk"], 1), scale=None, softcap=None, **options)


def _probe_inputs(kw):
    """Zero queries and identity values: the output row of query i is 1/count at its visible keys."""
    sq, sk = kw["sq"], kw["sk"]
    q = np.zeros((1, sq, 1, sk), np.float32)
    k = np.random.default_rng(0).standard_normal((1, sk, 1, sk)).astype(np.float32)
    v = np.eye(sk, dtype=np.float32)[None, :, None, :]
    options = {n: kw[n] for n in ("causal", "align", "window")}
    for name in ("q_segment_ids", "kv_segment_ids"):
        if name in kw:
            options[name] = kw[name].astype(np.int32)
    return q, k, v, options


def _seen(out, sk):
    return np.asarray(out, np.float64)[0, :, 0, :] > 0.5 / sk


def _check_jax(kw, backend):
    import jax.numpy as jnp

    q, k, v, options = _probe_inputs(kw)
    options = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    out = flashport.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), backend=backend, **options)
    np.testing.assert_array_equal(_seen(out, kw["sk"]), _want(kw))


# ----------------------------------------------------------------------------- the predicate itself


@settings(max_examples=200, **SETTINGS)
@given(calls())
def test_band_visible_is_the_reference(kw):
    """``band_visible`` (with the spec's offset and lengths) is the reference's positional rule."""
    spec = _spec(kw)
    i, j = np.arange(kw["sq"])[:, None], np.arange(kw["sk"])[None, :]
    got = band_visible(i + spec.offset, j, causal=spec.causal, left=spec.window_left, right=spec.window_right)
    want = _want({**kw, "q_segment_ids": None, "kv_segment_ids": None})
    np.testing.assert_array_equal(np.broadcast_to(True if got is None else got, want.shape), want)


# ----------------------------------------------------------------------------- block tables


def _tiles(want, bq, bk, nq, nk):
    """(visible somewhere, fully visible and unpadded) tile sets of a [Sq, Sk] visibility matrix."""
    sq, sk = want.shape
    some, full = set(), set()
    for i in range(nq):
        for j in range(nk):
            tile = want[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            if tile.any():
                some.add((i, j))
            if (i + 1) * bq <= sq and (j + 1) * bk <= sk and tile.all():
                full.add((i, j))
    return some, full


def _assert_tables(t, want, bq, bk):
    nq, nk = len(t.row_lo), len(t.col_lo)
    some, full = _tiles(want, bq, bk, nq, nk)
    rows = {(i, j) for i in range(nq) for j in range(t.row_lo[i], t.row_hi[i])}
    cols = {(i, j) for j in range(nk) for i in range(t.col_lo[j], t.col_hi[j])}
    fulls = {(i, j) for i in range(nq) for j in range(t.full_lo[i], t.full_hi[i])}
    assert rows == some, "key-block ranges must hold exactly the tiles with a visible pair"
    assert cols == some, "query-block ranges must hold exactly the tiles with a visible pair"
    assert fulls == full, "full ranges must hold exactly the unpadded, entirely visible tiles"


@settings(max_examples=150, **SETTINGS)
@given(calls(max_len=70, segments=False), st.integers(1, 24), st.integers(1, 24))
def test_block_tables_skip_only_invisible_tiles(kw, bq, bk):
    """The shared builder's static tables, and the blockwise backend's copy of them."""
    spec = _spec(kw)
    want = _want(kw)
    _assert_tables(block_ranges.block_tables(spec, bq, bk), want, bq, bk)
    tiling = _Tiling(spec, min(bq, spec.seq_q), min(bk, spec.seq_k))
    t = block_ranges.BlockTables(
        *(
            tuple(int(x) for x in a)
            for a in (tiling.kv_lo, tiling.kv_hi, tiling.full_lo, tiling.full_hi, tiling.q_lo, tiling.q_hi)
        )
    )
    _assert_tables(t, want, tiling.bq, tiling.bk)


@settings(max_examples=40, **SETTINGS)
@given(calls(max_len=90, segments=False), st.sampled_from([16, 32]), st.sampled_from([16, 64]))
def test_traced_block_bounds_match_the_tables(kw, bq, bk):
    """The Pallas GPU kernels' traced loop bounds (jnp ops) equal the static tables, and the Pallas
    TPU geometry's ranges are the tables of its blocks."""
    import jax
    import jax.numpy as jnp

    from flashport.kernels.backends.pallas_tpu.tiling import Geometry as TpuGeometry

    spec = _spec(kw)
    want = _want(kw)
    ops = block_ranges.Ops(jnp.minimum, jnp.maximum, jnp.where, jax.lax.div)
    pairs = (
        (block_ranges.key_blocks, "row"),
        (block_ranges.full_key_blocks, "full"),
        (block_ranges.query_blocks, "col"),
    )
    tables = block_ranges.block_tables(spec, bq, bk)
    for fn, name in pairs:
        for n in range(len(getattr(tables, f"{name}_lo"))):
            lo, hi = (int(x) for x in fn(spec, jnp.int32(n), bq, bk, ops))
            assert (lo, hi) == (getattr(tables, f"{name}_lo")[n], getattr(tables, f"{name}_hi")[n]), (name, n)
    g = TpuGeometry.make(spec, 32, 128)
    t = block_ranges.block_tables(spec, g.bq, g.bk)
    assert (g.row_lo, g.row_hi, g.col_lo, g.col_hi) == (t.row_lo, t.row_hi, t.col_lo, t.col_hi)
    _assert_tables(t, want, g.bq, g.bk)


# ----------------------------------------------------------------------------- backends (JAX)


@settings(max_examples=25, **SETTINGS)
@given(calls())
def test_xla_masking(kw):
    _check_jax(kw, "xla")


@settings(max_examples=20, **SETTINGS)
@given(calls(), st.integers(1, 8), st.integers(1, 8))
def test_blockwise_masking(kw, bq, bk):
    """Small random blocks, so block skipping and unmasked full tiles are exercised."""
    _check_jax(kw, registry.use("blockwise", block_q=bq, block_k=bk))


@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
@settings(max_examples=6, **SETTINGS)
@given(kw=calls(max_len=40))
def test_pallas_masking(backend, kw):
    """The Pallas kernels (interpreted on CPU) with their smallest blocks."""
    blocks = dict(block_q=16, block_k=16) if backend == "pallas_gpu_interpret" else {}
    _check_jax(kw, registry.use(backend, **blocks))


# ----------------------------------------------------------------------------- torch paths


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@settings(max_examples=30, **SETTINGS)
@given(kw=calls())
def test_torch_masking(backend, kw):
    """The torch math path and torch SDPA with the contract's explicit masks."""
    torch = pytest.importorskip("torch")
    import flashport.torch

    q, k, v, options = _probe_inputs(kw)
    options = {n: (torch.from_numpy(x) if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    out = flashport.torch.attention(
        *(torch.from_numpy(x) for x in (q, k, v)), backend=backend, **options, layout="BSHD"
    )
    np.testing.assert_array_equal(_seen(out.numpy(), kw["sk"]), _want(kw))


@settings(max_examples=60, **SETTINGS)
@given(
    st.integers(1, 6),
    st.lists(st.integers(0, 14), min_size=1, max_size=3),
    st.booleans(),
    st.one_of(
        st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 8)), st.one_of(st.none(), st.integers(0, 8)))
    ),
)
def test_kvcache_mask(s_q, extra, causal, window):
    """``kvcache_mask``: sequence b is a bottom-right call with ``lengths[b]`` keys, padded to the cache."""
    torch = pytest.importorskip("torch")
    from flashport.integrations.flash_attn_compat import kvcache_mask

    lengths = [s_q + e for e in extra]
    s_k = max(lengths) + 2
    got = kvcache_mask(torch.tensor(lengths), s_q, s_k, causal=causal, window=window).numpy()
    got = np.broadcast_to(got, (len(lengths), 1, s_q, s_k))  # rows may be broadcast (no causal/window)
    for b, n in enumerate(lengths):
        want = _want(dict(sq=s_q, sk=n, causal=causal, window=window, align="bottom_right"))
        np.testing.assert_array_equal(got[b, 0, :, :n], want)
        assert not got[b, 0, :, n:].any()


@settings(max_examples=60, **SETTINGS)
@given(
    st.lists(st.tuples(st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=3),
    st.booleans(),
    st.sampled_from(["bottom_right", "top_left"]),
    st.one_of(
        st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 6)), st.one_of(st.none(), st.integers(0, 6)))
    ),
    st.integers(0, 2),
)
def test_varlen_layout(lens, causal, align, window, pad):
    """Packed sequences: sequence b is its own call; padded tokens see nothing and are seen by none."""
    from flashport.kernels.contract.varlen import varlen_layout

    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])])
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])])
    total_q, total_k = int(cu_q[-1]) + pad, int(cu_k[-1]) + pad
    q_ids, kv_ids, mask = varlen_layout(
        cu_q, cu_k, total_q, total_k, causal=causal, window=window, align=align
    )
    got = np.asarray(mask) & (np.asarray(q_ids)[:, None] == np.asarray(kv_ids)[None, :])
    want = np.zeros((total_q, total_k), bool)
    for b, (sq, sk) in enumerate(lens):
        block = _want(dict(sq=sq, sk=sk, causal=causal, window=window, align=align))
        want[cu_q[b] : cu_q[b + 1], cu_k[b] : cu_k[b + 1]] = block
    np.testing.assert_array_equal(got, want)
