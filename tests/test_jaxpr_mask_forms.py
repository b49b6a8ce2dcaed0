"""A mask written as a multiply-add, ``s * m + (1 - m) * fill`` with ``m`` a 0/1 cast of a boolean.

For finite scores it equals ``where(m, s, fill)``; the pass fuses it as that mask (outputs and
gradients checked against the original program, fully masked rows included), and leaves alone the
forms that are not a mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxpr_util import assert_fused, count_sites

import flashport

B, N, T, D = 2, 3, 5, 8
PAD = jnp.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)  # batch 1 is fully padded: mean(V) rows


def _qkv(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, (B, N, T, D)) for key in (kq, kk, kv))


def _scores(q, k):
    return q @ k.swapaxes(-1, -2) * 0.3


def padding_mul_add(q, k, v):
    s = _scores(q, k)
    m = PAD[:, None, None, :].astype(s.dtype)
    return jax.nn.softmax(s * m + (1 - m) * -1e9) @ v


def causal_mul_add_fill_first(q, k, v):
    s = _scores(q, k)
    m = jnp.tril(jnp.ones((T, T), bool)).astype(s.dtype)
    return jax.nn.softmax(-1e9 * (1.0 - m) + m * s) @ v


def test_padding_mask_as_multiply_add_is_fused():
    assert_fused(padding_mul_add, _qkv(), 1)
    (site,) = flashport.find_attention(padding_mul_add)(*_qkv()).matches
    assert "mask" in site.mask and site.empty_rows == "mean"


def test_causal_mask_as_multiply_add_is_fused():
    assert_fused(causal_mul_add_fill_first, _qkv(), 1)


def test_multiply_add_with_two_different_masks_is_not_fused():
    other = jnp.array([[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]], bool)

    def f(q, k, v):
        s = _scores(q, k)
        m = PAD[:, None, None, :].astype(s.dtype)
        m2 = other[:, None, None, :].astype(s.dtype)
        return jax.nn.softmax(s * m + (1 - m2) * -1e9) @ v

    args = _qkv()
    assert count_sites(flashport.fuse_attention(f), *args) == 0
    np.testing.assert_array_equal(np.asarray(flashport.fuse_attention(f)(*args)), np.asarray(f(*args)))


def test_multiply_by_a_non_boolean_weight_is_not_a_mask():
    def f(q, k, v):
        s = _scores(q, k)
        m = jnp.linspace(0.0, 1.0, T)
        return jax.nn.softmax(s * m + (1 - m) * -1e9) @ v

    args = _qkv()
    assert count_sites(flashport.fuse_attention(f), *args) == 0
