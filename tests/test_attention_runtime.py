"""Runtime properties of flashport.attention: sharding, no leaks, O(S) memory, block skipping."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_attention

import flashport
from flashport.kernels.backends.blockwise import _Tiling
from flashport.kernels.contract import registry
from flashport.kernels.contract.spec import AttentionSpec

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_sharded_inputs_match_unsharded(backend):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharding_check.py"), backend],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_soak_500_jitted_calls_memory_flat():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 64, 4, 32)), jnp.float32)
    fn = jax.jit(lambda q: flashport.attention(q, q, q, causal=True, backend="blockwise"))
    for _ in range(50):  # warm up caches and allocator pools
        fn(q).block_until_ready()
    before = _rss_bytes()
    for i in range(500):
        fn(q + i).block_until_ready()
        flashport.attention(q, q, q, causal=True)  # the un-jitted entry point too
    grown = _rss_bytes() - before
    assert grown < 32 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 500 calls"


def _temp_bytes(seq: int) -> int:
    """Compiled scratch memory of a forward+backward step at sequence length ``seq``."""
    x = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(flashport.attention(q, k, v, causal=True, backend="blockwise"))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_training_memory_is_linear_in_sequence():
    small, large = _temp_bytes(4096), _temp_bytes(16384)
    # Materialized scores would grow 16x; linear memory grows 4x (plus constant slack).
    assert large < 5 * small, f"temp bytes {small} at S=4096 -> {large} at S=16384"
    assert large < 64 * 2**20  # the [S, S] f32 scores alone would be 2 GiB per head


@pytest.mark.parametrize("n", [1, 4, 16])
def test_causal_square_visits_only_lower_triangle(n):
    spec = AttentionSpec(
        scale=1.0,
        causal=True,
        window_left=None,
        window_right=None,
        offset=0,
        softcap=None,
        seq_q=n * 64,
        seq_k=n * 64,
    )
    tiling = _Tiling(spec, 64, 64)
    assert tiling.visited_blocks == n * (n + 1) // 2  # (n+1)/2n of the n*n blocks


def test_window_visits_band_only():
    spec = AttentionSpec(
        scale=1.0,
        causal=True,
        window_left=128,
        window_right=None,
        offset=0,
        softcap=None,
        seq_q=4096,
        seq_k=4096,
    )
    tiling = _Tiling(spec, 128, 128)
    assert tiling.visited_blocks == 32 + 31  # the diagonal blocks plus one block left of each
    # every visited block really holds a visible pair, every skipped one none
    for i in range(tiling.nq):
        for j in range(tiling.nk):
            q_pos = np.arange(i * 128, (i + 1) * 128)[:, None]
            k_pos = np.arange(j * 128, (j + 1) * 128)[None, :]
            any_visible = np.any((k_pos <= q_pos) & (k_pos >= q_pos - 128))
            assert any_visible == (tiling.kv_lo[i] <= j < tiling.kv_hi[i])


@settings(max_examples=10, deadline=None)
@given(
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    group=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 12)),
    right=st.one_of(st.none(), st.integers(0, 12)),
    align=st.sampled_from(["bottom_right", "top_left"]),
    softcap=st.one_of(st.none(), st.floats(0.5, 10)),
    block_q=st.sampled_from([4, 8, 32]),
    block_k=st.sampled_from([4, 16, 64]),
    layout=st.sampled_from(["BSHD", "BHSD"]),
)
def test_blockwise_random_shapes_and_options(
    sq, sk, group, causal, left, right, align, softcap, block_q, block_k, layout
):
    rng = np.random.default_rng(sq * 100 + sk)
    hkv, d = 2, 8
    shape_q = (1, sq, hkv * group, d) if layout == "BSHD" else (1, hkv * group, sq, d)
    shape_k = (1, sk, hkv, d) if layout == "BSHD" else (1, hkv, sk, d)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shape_q, shape_k, shape_k))
    window = None if left is None and right is None else (left, right)
    kwargs = dict(causal=causal, window=window, align=align, softcap=softcap, layout=layout)
    out, lse = flashport.attention(
        q,
        k,
        v,
        return_lse=True,
        backend=registry.use("blockwise", block_q=block_q, block_k=block_k),
        **kwargs,
    )
    want, want_lse = reference_attention(q, k, v, **kwargs)
    np.testing.assert_allclose(out, want, atol=3e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
