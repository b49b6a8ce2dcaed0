"""The Pallas TPU forward's counted work against a model of it computed here, independently.

The counts come from the kernel (``flashport.kernels.backends.pallas_tpu.counting``: interpreter counters per
tile body, mask ops in the lowered kernel jaxpr, K/V block-index changes over the grid). The model
comes from the reference's notion of visibility (the same brute force as ``tests/reference.py``:
query i sits at key position i + offset) over the real positions of every tile, and from the
pipeline rule that a block is fetched when its index differs from the previous grid step's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from band_spec import band_spec

from flashport.kernels.backends.pallas_tpu import backend, counting


def _keep(spec, q_seg=None, kv_seg=None):
    """[B, Sq, Sk] visibility of real positions, written from the contract (not from the kernels)."""
    i = np.arange(spec.seq_q)[:, None] + spec.offset
    j = np.arange(spec.seq_k)[None, :]
    keep = np.ones((spec.seq_q, spec.seq_k), bool)
    if spec.causal:
        keep &= j <= i
    if spec.window_left is not None:
        keep &= j >= i - spec.window_left
    if spec.window_right is not None:
        keep &= j <= i + spec.window_right
    keep = keep[None]
    if q_seg is not None:
        keep = keep & (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])
    return keep


def model_classes(spec, bq, bk, q_seg=None, kv_seg=None):
    """(full, partial) tiles per head summed over the batch: full = every real pair visible and no
    padded key in the tile; partial = some pair visible, not full."""
    keep = _keep(spec, q_seg, kv_seg)
    nq, nk = -(-spec.seq_q // bq), -(-spec.seq_k // bk)
    full = partial = 0
    for b in range(keep.shape[0]):
        for a in range(nq):
            for c in range(nk):
                tile = keep[b, a * bq : (a + 1) * bq, c * bk : (c + 1) * bk]
                if tile.all() and (c + 1) * bk <= spec.seq_k:
                    full += 1
                elif tile.any():
                    partial += 1
    return full, partial


def model_kv_fetches(spec, bq, bk, heads, kv_head_of):
    """K block fetches over a grid (heads, query blocks, steps): each row block visits its contiguous
    range of key blocks with a visible pair, then repeats the last one; a fetch happens on change."""
    keep = _keep(spec)[0]
    nq, nk = -(-spec.seq_q // bq), -(-spec.seq_k // bk)
    ranges = []
    for a in range(nq):
        cols = [c for c in range(nk) if keep[a * bq : (a + 1) * bq, c * bk : (c + 1) * bk].any()]
        ranges.append((cols[0], cols[-1] + 1) if cols else (0, 0))
    steps = max(1, max(hi - lo for lo, hi in ranges))
    seq = []
    for h in range(heads):
        for lo, hi in ranges:
            for s in range(steps):
                seq.append((kv_head_of(h), min(lo + min(s, max(hi - lo - 1, 0)), nk - 1)))
    return 1 + sum(x != y for x, y in zip(seq[1:], seq[:-1], strict=True))


def _arrays(b, sq, sk, hq, hkv, d, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, hq, sq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hkv, sk, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hkv, sk, d)), jnp.float32)
    return q, k, v


BLOCKS = dict(block_q=128, block_k=128)
CASES = {
    "causal_square_gqa2": (dict(sq=512, sk=512), dict(causal=True), 4, 2),
    "window_ragged_keys": (dict(sq=384, sk=500), dict(causal=True, left=400), 2, 1),
    "causal_top_left_sq>sk": (dict(sq=512, sk=300), dict(causal=True, align="top_left"), 2, 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_tiles_evaluate_no_mask_op(name):
    lengths, kw, hq, hkv = CASES[name]
    spec = band_spec(lengths["sq"], lengths["sk"], **kw)
    q, k, v = _arrays(1, lengths["sq"], lengths["sk"], hq, hkv, 128)
    counts = counting.tile_counts(q, k, v, spec=spec, options=BLOCKS)
    full, partial = model_classes(spec, 128, 128)
    assert (counts.full, counts.partial) == (hq * full, hq * partial)
    assert full > 0 and partial > 0
    ops = counting.mask_ops_per_tile(
        counting.forward_kernel_jaxpr(q, k, v, spec=spec, options=BLOCKS), 128, 128
    )
    assert ops["full"] == 0  # no iota, compare, logical op or select over the tile
    assert ops["partial"] >= 4  # two iotas, at least one compare, the select


def test_segment_ids_classify_uniform_tiles_as_full():
    sq = sk = 512
    seg = np.repeat(np.array([[0, 0, 1, 1, 1, 2, 2, 2]]), 64, axis=1).astype(
        np.int32
    )  # blocks 0, 1|mixed, ...
    spec = band_spec(sq, sk)
    q, k, v = _arrays(1, sq, sk, 2, 1, 128)
    counts = counting.tile_counts(
        q, k, v, spec=spec, options=BLOCKS, q_seg=jnp.asarray(seg), kv_seg=jnp.asarray(seg)
    )
    full, partial = model_classes(spec, 128, 128, seg, seg)
    assert counts.full == 2 * full > 0
    assert counts.partial >= 2 * partial  # interval overlap may visit a tile with no equal pair


def test_gqa_group_fetches_kv_group_times_less():
    spec = band_spec(512, 512, causal=True)
    for hq, hkv in ((4, 2), (8, 1), (8, 2)):
        q, k, v = _arrays(1, 512, 512, hq, hkv, 128)
        g = counting.forward_geometry(spec, q, k, v, BLOCKS)
        assert (g.bq, g.bk) == (128, 128)
        group = hq // hkv
        after = counting.kv_block_fetches(g, 1, hq, hkv)
        before = counting.kv_block_fetches(g, 1, hq, hkv, grouped=False)
        assert after == model_kv_fetches(spec, 128, 128, hkv, lambda h: h)
        assert before == model_kv_fetches(spec, 128, 128, hq, lambda h, group=group: h // group)
        assert before == group * after


@pytest.mark.parametrize("sk", [1000, 4096])
def test_decode_computes_a_quarter_of_the_padded_work(sk):
    hq, hkv, d = 4, 1, 128
    spec = band_spec(1, sk, causal=True)
    q, k, v = _arrays(1, 1, sk, hq, hkv, d)
    opts = dict(block_k=512)
    counts = counting.tile_counts(q, k, v, spec=spec, options=opts)
    macs = counting.padded_macs(counting.forward_kernel_jaxpr(q, k, v, spec=spec, options=opts), counts)
    skp = -(-sk // 512) * 512
    useful = hq * 1 * sk * 2 * d
    before = hq * 32 * skp * 2 * d  # the previous kernel: one query padded to a 32-row block per head
    assert macs == hq * 8 * skp * 2 * d
    assert useful <= macs <= before / 4


def test_backward_kernels_have_mask_free_full_bodies():
    spec = band_spec(512, 512, causal=True)
    q, k, v = _arrays(1, 512, 512, 4, 2, 128)
    kernels = counting.backward_kernel_jaxprs(q, k, v, spec=spec, options=BLOCKS)
    for kind in ("dkv", "dq"):
        ops = counting.mask_ops_per_tile(kernels[kind], 128, 128)
        assert ops["full"] == 0, kind
        assert ops["partial"] >= 4, kind  # the masked body is built and counted


def test_dkv_tiles_are_key_major_without_transposes():
    # The dK/dV kernel accumulates key rows, so it computes [bk, bq] tiles (K·Qᵀ, dO-side V·dOᵀ):
    # P and dS then multiply dO and Q as they are and the lse/di rows broadcast as they arrive.
    # Query-major [bq, bk] tiles need Pᵀ·dO, dSᵀ·Q and the rows as columns (a transpose each).
    # Non-square blocks tell the orientations apart; segment ids exercise their key-major layout.
    spec = band_spec(512, 512, causal=True, left=300)
    q, k, v = _arrays(1, 512, 512, 4, 2, 128)
    seg = jnp.asarray(np.repeat([[0, 1]], 256, axis=1), jnp.int32)
    bq, bk = 128, 256
    opts = dict(block_q_dkv=bq, block_k_dkv=bk)
    kernel = counting.backward_kernel_jaxprs(q, k, v, spec=spec, options=opts, q_seg=seg, kv_seg=seg)["dkv"]
    eqns = [eqn for eqn, _ in counting._walk(kernel, "")]
    assert not [e for e in eqns if e.primitive.name == "transpose"]
    dots = [tuple(e.outvars[0].aval.shape) for e in eqns if e.primitive.name == "dot_general"]
    assert (bk, bq) in dots and (bq, bk) not in dots, dots
    assert set(dots) <= {(bk, bq), (bk, 128)}, dots


def _grid(fn, args, name):
    """The grid of the ``pallas_call`` named ``name`` in ``fn``'s traced program."""
    for eqn, _ in counting._walk(jax.make_jaxpr(fn)(*args).jaxpr, ""):
        if eqn.primitive.name == "pallas_call" and eqn.params["name"] == name:
            return tuple(eqn.params["grid_mapping"].grid)
    raise LookupError(name)


def test_dq_fetches_kv_once_per_group():
    spec = band_spec(512, 512, causal=True)
    for hq, hkv in ((4, 2), (8, 1), (8, 2)):
        q, k, v = _arrays(1, 512, 512, hq, hkv, 128)
        g = counting.dq_geometry(spec, q, k, v, BLOCKS)
        assert (g.bq, g.bk) == (128, 128)
        group = hq // hkv
        after = counting.kv_block_fetches(g, 1, hq, hkv)
        before = counting.kv_block_fetches(g, 1, hq, hkv, grouped=False)
        assert after == model_kv_fetches(spec, 128, 128, hkv, lambda h: h)
        assert before == group * after
        # The dQ kernel itself walks kv heads: its grid is (B, Hkv / head_block, nq, steps_k), not
        # (B, Hq, ...); a head block fetches the K/V blocks of its kv heads in one DMA.
        cfg = counting._config(spec, BLOCKS)
        out, lse = jnp.zeros((1, hq, 512, 128)), jnp.zeros((1, hq, 512))

        def bwd(q, k, v, cfg=cfg, out=out, lse=lse):
            return backend._backward_local(cfg, q, k, v, None, None, None, None, out, lse, out, lse, None)

        assert hkv % g.head_block == 0
        assert _grid(bwd, (q, k, v), "flashport_flash_dq") == (1, hkv // g.head_block, g.nq, g.steps_k)


@pytest.mark.parametrize("grad,return_lse", [(False, False), (False, True), (True, False)])
def test_forward_writes_compact_lse_and_none_for_inference(grad, return_lse):
    b, s, h = 1, 1024, 4
    q = jnp.zeros((b, s, h, 128), jnp.bfloat16)
    written = counting.lse_bytes_written(q, q, q, grad=grad, causal=True, return_lse=return_lse)
    lane_replicated = b * h * s * 128 * 4  # the previous [B, H, S, 128] f32 lse
    assert written == (b * h * s * 4 if grad or return_lse else 0)
    assert written * 128 <= lane_replicated
