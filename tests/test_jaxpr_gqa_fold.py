"""K/V repeated over heads in the program are folded back to the contract's GQA.

``jnp.repeat(k, G, axis=heads)`` and ``broadcast_to(k[.., None, ..]) + reshape`` make query head ``h``
read kv head ``h // G``, the contract's grouping: the fused call must receive the un-repeated K/V
(Hkv heads), with outputs and gradients equal to the original program's. ``jnp.tile`` (and the
broadcast it amounts to) reads kv head ``h % Hkv``: it must never be folded that way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import assert_fused, attention_calls
from reference import reference_attention

import flashport

B, T, S, HKV, G, D = 2, 5, 7, 2, 3, 8
HQ = HKV * G


def _args(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(kq, (B, T, HQ, D)),
        jax.random.normal(kk, (B, S, HKV, D)),
        jax.random.normal(kv, (B, S, HKV, D)),
    )


def _attend(q, k, v):  # BTND with Hq heads on every operand
    s = jnp.einsum("btnd,bsnd->bnts", q, k) * 0.3
    return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(s, -1), v)


def with_repeat(q, k, v):
    return _attend(q, jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2))


def with_broadcast_reshape(q, k, v):
    def rep(x):
        return jnp.broadcast_to(x[:, :, :, None], (B, S, HKV, G, D)).reshape(B, S, HQ, D)

    return _attend(q, rep(k), rep(v))


def with_repeat_bhsd_matmul(q, k, v):
    """Repeat in BHSD after a transpose, scale on the repeated k, matmul spelling."""
    k = jnp.repeat(k.transpose(0, 2, 1, 3), G, axis=1)
    v = jnp.repeat(v.transpose(0, 2, 1, 3), G, axis=1)
    s = q.transpose(0, 2, 1, 3) @ (k * 0.3).swapaxes(-1, -2)
    return (jax.nn.softmax(s) @ v).transpose(0, 2, 1, 3)


def with_tile(q, k, v):
    return _attend(q, jnp.tile(k, (1, 1, G, 1)), jnp.tile(v, (1, 1, G, 1)))


def with_tile_as_broadcast(q, k, v):
    def rep(x):  # copies outside the kv heads: head h reads kv head h % HKV
        return jnp.broadcast_to(x[:, :, None], (B, S, G, HKV, D)).reshape(B, S, HQ, D)

    return _attend(q, rep(k), rep(v))


def _kv_heads_of_call(fn, args):
    """Head counts of K and V (BSHD) as the fused program's flashport.attention call receives them."""
    (call,) = attention_calls(jax.make_jaxpr(flashport.fuse_attention(fn))(*args).jaxpr, nested=True)
    q, k, v = (x.aval.shape for x in call.invars[:3])
    heads = [dim for dim in q if dim == HQ]
    assert heads, q
    return [sh[next(i for i, dim in enumerate(q) if dim == HQ)] for sh in (k, v)]


@pytest.mark.parametrize("fn", [with_repeat, with_broadcast_reshape, with_repeat_bhsd_matmul])
def test_head_repeat_is_folded_to_gqa(fn):
    args = _args()
    assert_fused(fn, args, 1)
    assert _kv_heads_of_call(fn, args) == [HKV, HKV]
    (site,) = flashport.find_attention(fn)(*args).matches
    assert site.gqa == G and math.prod(site.k) == math.prod(site.v) == B * S * HKV * D
    want, _ = reference_attention(*args, scale=0.3)  # the contract's GQA, float64
    np.testing.assert_allclose(np.asarray(flashport.fuse_attention(fn)(*args), np.float64), want, atol=2e-5)


@pytest.mark.parametrize("fn", [with_tile, with_tile_as_broadcast])
def test_tile_is_not_folded(fn):
    args = _args(1)
    assert_fused(fn, args, 1)
    assert _kv_heads_of_call(fn, args) == [HQ, HQ]


def test_mqa_broadcast_of_one_head_is_folded():
    def f(q, k, v):
        k, v = (jnp.broadcast_to(x[:, :, :1], (B, S, HQ, D)) for x in (k, v))
        return _attend(q, k, v)

    args = _args(2)
    assert_fused(f, args, 1)
    assert _kv_heads_of_call(f, args) == [1, 1]


def test_only_k_repeated_is_not_folded():
    def f(q, k, v):
        return _attend(q, jnp.repeat(k, G, axis=2), jnp.concatenate([v] * G, axis=2))

    args = _args(3)
    assert_fused(f, args, 1)
    assert _kv_heads_of_call(f, args) == [HQ, HQ]


def test_repeat_with_padding_mask_and_empty_rows():
    """The fully-masked-row fill (mean(V)) must use the right kv head after folding."""
    pad = jnp.array([[1, 1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0]], bool)

    def f(q, k, v):
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        s = jnp.einsum("btnd,bsnd->bnts", q, k) * 0.3
        s = jnp.where(pad[:, None, None, :], s, -1e9)
        return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(s, -1), v)

    args = _args(4)
    assert_fused(f, args, 1)
    assert _kv_heads_of_call(f, args) == [HKV, HKV]
