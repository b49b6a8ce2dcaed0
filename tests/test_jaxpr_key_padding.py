"""Padding masks built from a [B, S] array reach the kernel as kv segment ids, not as a mask array.

A boolean ``where`` mask that varies only over batch and keys (``mask[:, None, None, :]``) means
exactly ``kv_segment_ids = mask, q_segment_ids = 1``; fully padded rows keep the original program's
value (mean(V) for a finite fill, NaN for -inf) as for any mask. The additive form
``(1 - mask) * -1e9`` is *not* converted: on a fully padded row it gives ``softmax(s - 1e9)``, which
is not what the contract returns for a row with no visible key, so it stays an additive bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import assert_fused, attention_calls
from reference import reference_attention

import flashport

B, N, T, D = 2, 3, 5, 8
PAD = jnp.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], bool)
EMPTY = jnp.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)  # batch 1 fully padded


def _qkv(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, (B, N, T, D)) for key in (kq, kk, kv))


def _scores(q, k):
    return q @ k.swapaxes(-1, -2) * 0.3


def where_padding(q, k, v, pad):
    s = jnp.where(pad[:, None, None, :], _scores(q, k), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(s) @ v


def where_padding_inverted_and_causal(q, k, v, pad):
    s = _scores(q, k)
    s = jnp.where(~pad[:, None, None, :], -jnp.inf, s)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jax.nn.softmax(s) @ v


def additive_padding(q, k, v, pad):
    bias = (1.0 - pad.astype(jnp.float32))[:, None, None, :] * -1e9
    return jax.nn.softmax(_scores(q, k) + bias) @ v


def _call_kwargs(fn, args):
    """The operands of the fused program's flashport.attention call: (q, k, v, bias, mask, q_seg, kv_seg)."""
    (call,) = attention_calls(jax.make_jaxpr(flashport.fuse_attention(fn))(*args).jaxpr, nested=True)
    return [x.aval for x in call.invars]


def _has(avals, dtype, shape):
    return any(a.dtype == dtype and tuple(a.shape) == shape for a in avals)


@pytest.mark.parametrize("pad", [PAD, EMPTY], ids=["padded", "fully-padded-row"])
def test_where_padding_becomes_segment_ids(pad):
    args = (*_qkv(), pad)
    assert_fused(where_padding, args, 1, argnums=(0, 1, 2))
    avals = _call_kwargs(where_padding, args)
    assert _has(avals, jnp.int32, (B, T)) and not any(a.dtype == jnp.bool_ for a in avals), avals
    (site,) = flashport.find_attention(where_padding)(*args).matches
    assert "key-padding" in site.mask
    if pad is PAD:  # no empty row: the float64 contract reference with segment ids agrees
        want, _ = reference_attention(
            *args[:3],
            scale=0.3,
            layout="BHSD",
            q_segment_ids=np.ones((B, T)),
            kv_segment_ids=np.asarray(pad, np.int64),
        )
        got = flashport.fuse_attention(where_padding)(*args)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5)
    else:  # the original's finite fill: mean(V) on the fully padded batch
        got = flashport.fuse_attention(where_padding)(*args)
        np.testing.assert_allclose(
            np.asarray(got[1]), np.broadcast_to(args[2][1].mean(1, keepdims=True), (N, T, D)), atol=1e-6
        )


def test_inverted_padding_with_causal_and_inf_fill():
    args = (*_qkv(1), PAD)
    assert_fused(where_padding_inverted_and_causal, args, 1, argnums=(0, 1, 2))
    avals = _call_kwargs(where_padding_inverted_and_causal, args)
    assert _has(avals, jnp.int32, (B, T))
    # a fully padded row: outputs only (its gradients are NaN in the original, 0 fused: see fuse.py)
    args = (*_qkv(1), EMPTY)
    got = flashport.fuse_attention(where_padding_inverted_and_causal)(*args)
    np.testing.assert_allclose(
        np.asarray(got[0]), np.asarray(where_padding_inverted_and_causal(*args)[0]), atol=2e-5
    )
    assert np.isnan(np.asarray(got[1])).all()  # -inf fill, no visible key: NaN as in the original


def test_additive_padding_stays_a_bias():
    args = (*_qkv(2), EMPTY)
    assert_fused(additive_padding, args, 1, argnums=(0, 1, 2))
    avals = _call_kwargs(additive_padding, args)
    assert not _has(avals, jnp.int32, (B, T))
    assert _has(avals, jnp.float32, (B, 1, 1, T))


def test_per_query_mask_is_not_key_padding():
    m = jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (B, T, T)).at[:, :, 0].set(True)

    def f(q, k, v, m):
        return jax.nn.softmax(jnp.where(m[:, None], _scores(q, k), -1e9)) @ v

    args = (*_qkv(3), m)
    assert_fused(f, args, 1, argnums=(0, 1, 2))
    avals = _call_kwargs(f, args)
    assert not _has(avals, jnp.int32, (B, T)) and any(a.dtype == jnp.bool_ for a in avals)
