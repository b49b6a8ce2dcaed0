"""Softmax normalized after the P·V product: ``(exp(s - max) @ v) / sum(exp(s - max))``.

Memory-conscious code divides the [.., T, Dv] product instead of the [.., T, S] probabilities. The
pass fuses it (division, multiply by ``1 / sum`` or by ``jnp.reciprocal``), with output and gradient
parity against the original program and the float64 contract reference, and leaves alone products
divided by anything else than the sum of their own rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import assert_fused, count_sites
from reference import reference_attention

import flashport

B, N, T, D = 2, 3, 5, 8
PAD = jnp.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)  # batch 1 fully padded: mean(V) rows


def _qkv(seed=0, shape=(B, N, T, D)):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, shape) for key in (kq, kk, kv))


def _exp(s):
    return jnp.exp(s - jnp.max(s, -1, keepdims=True))


def divide(q, k, v):
    e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
    return (e @ v) / jnp.sum(e, -1, keepdims=True)


def times_one_over(q, k, v):
    e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
    return (e @ v) * (1.0 / jnp.sum(e, -1, keepdims=True))


def times_reciprocal(q, k, v):
    e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
    return (e @ v) * jnp.reciprocal(jnp.sum(e, -1, keepdims=True))


def sum_after_product(q, k, v):  # the sum is computed after the product, without keepdims
    e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
    num = e @ v
    return num / jnp.sum(e, -1)[..., None]


@pytest.mark.parametrize("fn", [divide, times_one_over, times_reciprocal, sum_after_product])
def test_normalized_after_pv_is_fused_with_parity(fn):
    args = _qkv()
    assert_fused(fn, args, 1)
    (site,) = flashport.find_attention(fn)(*args).matches
    assert site.scale == pytest.approx(0.3)
    want, _ = reference_attention(*args, scale=0.3, layout="BHSD")
    got = flashport.fuse_attention(fn)(*args)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)


def test_einsum_layout_with_padding_mask_and_empty_rows():
    """BTND einsums, a where-mask that empties batch 1: the original gives mean(V) there, so must the fused."""

    def f(q, k, v):
        s = jnp.einsum("btnd,bsnd->bnts", q, k) * 0.25
        s = jnp.where(PAD[:, None, None, :], s, jnp.finfo(s.dtype).min)
        e = jnp.exp(s - jnp.max(s, -1, keepdims=True))
        num = jnp.einsum("bnts,bsnd->btnd", e, v)
        den = jnp.sum(e, -1)  # [b, n, t]
        return num / jnp.transpose(den, (0, 2, 1))[..., None]

    args = _qkv(1, (B, T, N, D))
    assert_fused(f, args, 1)
    out = flashport.fuse_attention(f)(*args)
    np.testing.assert_allclose(np.asarray(out[1]), np.broadcast_to(args[2][1].mean(0), (T, N, D)), atol=1e-6)


def test_bf16_exp_summed_in_float32():
    def f(q, k, v):
        e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
        return ((e @ v).astype(jnp.float32) / jnp.sum(e.astype(jnp.float32), -1, keepdims=True)).astype(
            q.dtype
        )

    args = tuple(x.astype(jnp.bfloat16) for x in _qkv(2))
    assert_fused(f, args, 1, atol=2e-2, rtol=2e-2)


def test_inside_checkpoint_and_scan():
    def f(q, k, v):
        def body(c, x):
            return c, jax.checkpoint(divide)(x, k, v)

        return jax.lax.scan(body, 0.0, jnp.stack([q, q * 2]))[1]

    assert_fused(f, _qkv(3), 1)


def _not_fused(fn, args):
    fused = flashport.fuse_attention(fn)
    assert count_sites(fused, *args) == 0
    np.testing.assert_allclose(np.asarray(fused(*args)), np.asarray(fn(*args)), atol=1e-6)
    (miss,) = flashport.find_attention(fn)(*args).near_misses
    return miss.reason


def test_divided_by_the_sum_of_other_rows_is_not_fused():
    def f(q, k, v):  # B == N here: the sum's batch and head axes swapped
        e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
        return (e @ v) / jnp.swapaxes(jnp.sum(e, -1, keepdims=True), 0, 1)

    reason = _not_fused(f, _qkv(4, (3, 3, T, D)))
    assert "other rows" in reason


def test_divided_by_a_different_sum_is_not_fused():
    def f(q, k, v):
        e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
        return (e @ v) / (jnp.sum(e, -1, keepdims=True) + 1.0)

    reason = _not_fused(f, _qkv(5))
    assert "other than the sum" in reason


def test_unnormalized_product_also_returned_is_not_fused():
    def f(q, k, v):
        e = _exp(q @ k.swapaxes(-1, -2) * 0.3)
        num = e @ v
        return num / jnp.sum(e, -1, keepdims=True), num

    fused = flashport.fuse_attention(f)
    args = _qkv(6)
    assert count_sites(fused, *args) == 0
    for w, g in zip(f(*args), fused(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_exp_without_any_normalization_is_not_fused():
    def f(q, k, v):
        return _exp(q @ k.swapaxes(-1, -2) * 0.3) @ v

    reason = _not_fused(f, _qkv(7))
    assert "normalized" in reason
