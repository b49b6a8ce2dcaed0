"""Dropout in the Pallas TPU kernels (run in the TPU interpreter) against the float64 reference.

tests/test_dropout.py already checks ``pallas_tpu_interpret`` like every backend (default blocks).
Here the kernels' tiling is varied: the keep-mask is hashed tile by tile from absolute positions, so
it must not depend on the block sizes, on padded tails (Sq, Sk not multiples of the blocks), on
GQA (the query head, not the kv head, enters the hash), or on the backward kernels using blocks
other than the forward's. The reference mask is tests/reference.py's ``dropout_keep``, written from
the contract's definition, never the kernel's own helper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import dropout_keep, reference_attention, reference_attention_vjp

import flashport
from flashport.kernels.contract import registry

SEED = 5
WORDS = (SEED >> 32, SEED & 0xFFFFFFFF)  # the seed words of jax.random.key(SEED)

# (block_q, block_k) of the forward; sequences 50 x 200 are ragged against all of them.
BLOCKS = [(32, 128), (64, 128), (32, 256), (64, 256)]


def _read_mask(options, rate, b=2, hq=4, hkv=2, sq=50, sk=200):
    """The kernels' keep-mask [B, Hq, Sq, Sk].

    With zero scores and V = I per kv head, out = Z / ((1 - rate) Sk).
    """
    q = jnp.zeros((b, sq, hq, 8), jnp.float32)
    k = jnp.zeros((b, sk, hkv, 8), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(sk, dtype=jnp.float32)[None, :, None, :], (b, sk, hkv, sk))
    backend = registry.use("pallas_tpu_interpret", **options)
    out = flashport.attention(q, k, v, dropout_rate=rate, dropout_rng=jax.random.key(SEED), backend=backend)
    out = np.asarray(jnp.swapaxes(out, 1, 2))
    kept = out != 0
    # Kept entries carry exactly the rescaled uniform probability.
    np.testing.assert_allclose(out[kept], 1.0 / ((1.0 - rate) * sk), rtol=1e-6)
    return kept


@pytest.mark.parametrize("block_q,block_k", BLOCKS)
def test_mask_is_the_reference_mask_for_every_block_size_with_gqa_and_padding(block_q, block_k):
    mask = _read_mask(dict(block_q=block_q, block_k=block_k), rate=0.4)
    np.testing.assert_array_equal(mask, dropout_keep(WORDS, 0.4, mask.shape))


def test_mask_distinguishes_query_heads_of_one_kv_group():
    # MQA: all 4 query heads share one kv head; their masks must still be their own (h = query head).
    mask = _read_mask(dict(block_q=32, block_k=128), rate=0.5, b=1, hq=4, hkv=1, sq=40, sk=130)
    np.testing.assert_array_equal(mask, dropout_keep(WORDS, 0.5, mask.shape))
    assert not np.array_equal(mask[0, 0], mask[0, 1])


def _inputs(b=2, sq=50, sk=200, hq=4, hkv=2, d=64, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


@pytest.mark.parametrize(
    "options, kwargs",
    [
        # Backward kernels tiled differently from the forward and from each other.
        (
            dict(block_q=32, block_k=128, block_q_dkv=64, block_k_dkv=256, block_q_dq=96, block_k_dq=128),
            dict(causal=True),
        ),
        (
            dict(block_q=64, block_k=256, block_q_dkv=32, block_k_dkv=128, block_q_dq=32, block_k_dq=256),
            dict(window=(30, 10), softcap=4.0),
        ),
    ],
    ids=["causal", "window_softcap"],
)
def test_forward_and_grads_match_reference_when_backward_blocks_differ(options, kwargs):
    q, k, v, do = _inputs()
    rate = 0.3
    backend = registry.use("pallas_tpu_interpret", **options)

    def f(q, k, v):
        return flashport.attention(
            q,
            k,
            v,
            dropout_rate=rate,
            dropout_rng=jax.random.key(SEED),
            backend=backend,
            return_lse=True,
            **kwargs,
        )

    (out, lse), vjp = jax.vjp(f, q, k, v)
    grads = vjp((do, jnp.zeros_like(lse)))
    ref_out, ref_lse = reference_attention(q, k, v, dropout_rate=rate, dropout_seed=WORDS, **kwargs)
    ref_grads = reference_attention_vjp(q, k, v, do, dropout_rate=rate, dropout_seed=WORDS, **kwargs)[:3]
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5)  # lse ignores dropout
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


def test_bfloat16_dropout_matches_reference():
    q, k, v, do = (x.astype(jnp.bfloat16) for x in _inputs(b=1, hq=2, hkv=1))
    rate = 0.2
    backend = registry.use("pallas_tpu_interpret", block_q=32, block_k=128)

    def f(q, k, v):
        return flashport.attention(
            q, k, v, causal=True, dropout_rate=rate, dropout_rng=jax.random.key(SEED), backend=backend
        )

    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(do)
    ref_out, _ = reference_attention(q, k, v, causal=True, dropout_rate=rate, dropout_seed=WORDS)
    ref_grads = reference_attention_vjp(q, k, v, do, causal=True, dropout_rate=rate, dropout_seed=WORDS)[:3]
    np.testing.assert_allclose(
        np.asarray(out, np.float32), ref_out, atol=3e-2 * max(1, np.abs(ref_out).max())
    )
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, atol=6e-2 * max(1, np.abs(want).max()), err_msg=f"d{name}"
        )
