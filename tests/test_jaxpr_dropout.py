"""Attention-weight dropout in a traced program: fused into the contract's dropout only on opt-in.

``fuse_attention(f, dropout="contract")`` replaces ``softmax(s) * keep / keep_prob`` (in the
spellings of Flax, Haiku, Equinox/Keras and ``uniform < keep``) by
``flashport.attention(..., dropout_rate=1 - keep_prob, dropout_rng=key)`` with the program's key. The
fused output is checked against the float64 reference of the contract's dropout (tests/reference.py,
which writes the keep-mask out from the contract's definition) and against ``flashport.attention``;
its kept fraction and its mean over keys against the no-dropout attention. Without the opt-in the
program runs as written and the site is a near-miss naming the option.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import count_sites
from reference import reference_attention, reference_attention_vjp

import flashport

B, T, S, N, D = 2, 8, 16, 2, 8
SCALE = 0.35
RATE = 0.25
KEEP = 1.0 - RATE
SEED = 5


def _qkv(seed=0, dv=D):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, N, D), jnp.float32)
    k = jax.random.normal(kk, (B, S, N, D), jnp.float32)
    v = jax.random.normal(kv, (B, S, N, dv), jnp.float32)
    return q, k, v


def _probs(q, k):
    return jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE, axis=-1)


def _pv(p, v):
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def flax_style(q, k, v, key):
    """flax.linen.dot_product_attention with dropout_rng (broadcast_dropout=False)."""
    p = _probs(q, k)
    keep = jax.random.bernoulli(key, KEEP, p.shape)
    return _pv(p * (keep.astype(p.dtype) / jnp.asarray(KEEP, p.dtype)), v)


def flax_broadcast_style(q, k, v, key):
    """flax's default broadcast_dropout=True: one [1, 1, T, S] mask shared over batch and heads."""
    p = _probs(q, k)
    keep = jax.random.bernoulli(key, KEEP, (1, 1, T, S))
    return _pv(p * (keep.astype(p.dtype) / KEEP), v)


def haiku_style(q, k, v, key):
    """hk.dropout: ``keep * x / keep_rate``."""
    p = _probs(q, k)
    keep = jax.random.bernoulli(key, KEEP, p.shape)
    return _pv(keep * p / KEEP, v)


def where_style(q, k, v, key):
    """equinox.nn.Dropout / keras Dropout: ``where(keep, x / keep_prob, 0)``."""
    p = _probs(q, k)
    keep = jax.random.bernoulli(key, KEEP, p.shape)
    return _pv(jnp.where(keep, p / KEEP, 0.0), v)


def uniform_style(q, k, v, key):
    """A keep-mask written as ``uniform(key) < keep_prob``."""
    p = _probs(q, k)
    keep = jax.random.uniform(key, p.shape) < KEEP
    return _pv(p * keep.astype(p.dtype) * (1.0 / KEEP), v)


SPELLINGS = [flax_style, haiku_style, where_style, uniform_style, flax_broadcast_style]


def _words(seed):
    return (seed >> 32, seed & 0xFFFFFFFF)


def test_dropout_is_left_alone_by_default_with_a_reason_naming_the_opt_in():
    q, k, v = _qkv()
    key = jax.random.key(SEED)
    fused = flashport.fuse_attention(flax_style)
    assert count_sites(fused, q, k, v, key) == 0
    np.testing.assert_array_equal(np.asarray(fused(q, k, v, key)), np.asarray(flax_style(q, k, v, key)))
    (miss,) = flashport.find_attention(flax_style)(q, k, v, key).near_misses
    assert 'dropout="contract"' in miss.reason and "rate 0.25" in miss.reason, miss.reason


@pytest.mark.parametrize("fn", SPELLINGS, ids=lambda f: f.__name__)
def test_contract_dropout_equals_flashport_attention_and_the_float64_reference(fn):
    q, k, v = _qkv()
    key = jax.random.key(SEED)
    fused = flashport.fuse_attention(fn, dropout="contract")
    assert count_sites(fused, q, k, v, key) == 1, flashport.find_attention(fn, dropout="contract")(
        q, k, v, key
    )
    got = np.asarray(jax.jit(fused)(q, k, v, key))
    api = flashport.attention(q, k, v, scale=SCALE, dropout_rate=RATE, dropout_rng=key)
    np.testing.assert_allclose(got, np.asarray(api), atol=1e-6, rtol=1e-6)
    ref, _ = reference_attention(q, k, v, scale=SCALE, dropout_rate=RATE, dropout_seed=_words(SEED))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
    (site,) = flashport.find_attention(fn, dropout="contract")(q, k, v, key).matches
    assert "dropout rate=0.25" in site.mask, site.mask


@pytest.mark.parametrize("fn", [flax_style, where_style], ids=lambda f: f.__name__)
def test_contract_dropout_gradients_match_the_float64_reference(fn):
    q, k, v = _qkv(1)
    key = jax.random.key(SEED)
    fused = flashport.fuse_attention(fn, dropout="contract")
    w = jnp.cos(jnp.arange(B * T * N * D, dtype=jnp.float32)).reshape(B, T, N, D)
    grads = jax.jit(jax.grad(lambda a, b, c: jnp.sum(fused(a, b, c, key) * w), argnums=(0, 1, 2)))(q, k, v)
    ref = reference_attention_vjp(q, k, v, w, scale=SCALE, dropout_rate=RATE, dropout_seed=_words(SEED))
    for got, want in zip(grads, ref[:3], strict=True):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_kept_fraction_and_mean_over_keys_is_the_no_dropout_attention():
    """With V the identity over keys, the output rows are the dropped-out probabilities themselves."""
    q, k, _ = _qkv(2)
    v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, N, S))
    fused = flashport.fuse_attention(flax_style, dropout="contract")
    n = 200
    outs = np.asarray(
        jax.jit(jax.vmap(lambda key: fused(q, k, v, key)))(jax.random.split(jax.random.key(9), n))
    )
    kept = float((outs != 0).mean())
    sigma = np.sqrt(RATE * (1 - RATE) / outs.size)
    assert abs(kept - KEEP) < 5 * sigma, (kept, KEEP)
    plain, _ = reference_attention(q, k, v, scale=SCALE)  # no dropout: the expectation
    mean, sem = outs.mean(axis=0), outs.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(mean - plain) < 5 * sem + 1e-6)
    nonzero = outs[outs != 0]
    expected = (plain[None] / KEEP * np.ones_like(outs))[outs != 0]
    np.testing.assert_allclose(nonzero, expected, rtol=1e-5)  # kept entries are scaled by 1/keep_prob


def _no_rescale(q, k, v, key):
    p = _probs(q, k)
    return _pv(p * jax.random.bernoulli(key, KEEP, p.shape), v)


def _wrong_rescale(q, k, v, key):
    p = _probs(q, k)
    return _pv(jnp.where(jax.random.bernoulli(key, KEEP, p.shape), p / 0.5, 0.0), v)


def _two_masks(q, k, v, key):
    p = _probs(q, k)
    k1, k2 = jax.random.split(key)
    p = jnp.where(jax.random.bernoulli(k1, KEEP, p.shape), p / KEEP, 0.0)
    return _pv(jnp.where(jax.random.bernoulli(k2, KEEP, p.shape), p / KEEP, 0.0), v)


def _rescaled_without_mask(q, k, v, key):
    del key
    return _pv(_probs(q, k) * 2.0, v)


@pytest.mark.parametrize(
    "fn, reason",
    [
        (_no_rescale, "not inverted dropout"),
        (_wrong_rescale, "not inverted dropout"),
        (_two_masks, "two dropout keep-masks"),
        (_rescaled_without_mask, "rescaled by a constant without a dropout keep-mask"),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_dropout_that_is_not_the_contracts_stays_unfused_even_with_the_opt_in(fn, reason):
    q, k, v = _qkv()
    key = jax.random.key(SEED)
    fused = flashport.fuse_attention(fn, dropout="contract")
    assert count_sites(fused, q, k, v, key) == 0
    np.testing.assert_array_equal(np.asarray(fused(q, k, v, key)), np.asarray(fn(q, k, v, key)))
    misses = flashport.find_attention(fn, dropout="contract")(q, k, v, key).near_misses
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]


def test_bad_dropout_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"dropout must be None .* or 'contract'"):
        flashport.fuse_attention(flax_style, dropout="yes")
    with pytest.raises(ValueError, match="dropout must be"):
        flashport.find_attention(flax_style, dropout=True)


def test_flax_linen_mha_with_dropout_fuses_only_with_the_opt_in():
    nn = pytest.importorskip("flax.linen")
    e, heads = 16, 2
    module = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=e, dropout_rate=0.1)
    x = jax.random.normal(jax.random.key(1), (B, T, e))
    params = module.init(jax.random.key(0), x, x, deterministic=True)

    def f(params, x, key):
        return module.apply(params, x, x, deterministic=False, rngs={"dropout": key})

    key = jax.random.key(3)
    assert count_sites(flashport.fuse_attention(f), params, x, key) == 0
    (miss,) = flashport.find_attention(f)(params, x, key).near_misses
    assert 'dropout="contract"' in miss.reason, miss.reason
    fused = flashport.fuse_attention(f, dropout="contract")
    assert count_sites(fused, params, x, key) == 1
    (site,) = flashport.find_attention(f, dropout="contract")(params, x, key).matches
    assert "dropout rate=0.1" in site.mask, site.mask
    # the mean over dropout keys is the deterministic module's output
    n = 200
    outs = np.asarray(jax.jit(jax.vmap(lambda kk: fused(params, x, kk)))(jax.random.split(key, n)))
    plain = np.asarray(module.apply(params, x, x, deterministic=True))
    mean, sem = outs.mean(axis=0), outs.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(mean - plain) < 5 * sem + 1e-5)
    assert not np.allclose(outs[0], plain, atol=1e-3)  # dropout is applied
    # gradients flow through the fused dropout: finite, and their mean over keys is the deterministic one
    w = jnp.cos(jnp.arange(plain.size, dtype=jnp.float32)).reshape(plain.shape)
    loss = lambda p, kk: jnp.sum(fused(p, x, kk) * w)  # noqa: E731
    g_plain = jax.grad(lambda p: jnp.sum(module.apply(p, x, x, deterministic=True) * w))(params)
    g_keys = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, jax.random.split(key, 64))
    for gk, gp in zip(jax.tree_util.tree_leaves(g_keys), jax.tree_util.tree_leaves(g_plain), strict=True):
        gk, gp = np.asarray(gk), np.asarray(gp)
        assert np.all(np.isfinite(gk))
        assert np.abs(gk.mean(0) - gp).max() < 0.2 * np.abs(gp).max() + 1e-4


def test_equinox_mha_with_dropout_equals_flashport_attention_with_its_first_key():
    """Equinox vmaps over examples and heads with split keys: the fused site takes the first key."""
    eqx = pytest.importorskip("equinox")
    e, heads = 16, 2
    module = eqx.nn.MultiheadAttention(num_heads=heads, query_size=e, dropout_p=0.2, key=jax.random.key(2))
    params, static = eqx.partition(module, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (B, T, e))

    def f(params, x, key):
        m = eqx.combine(params, static)
        keys = jax.random.split(key, B)
        return jax.vmap(lambda xx, kk: m(xx, xx, xx, key=kk, inference=False))(x, keys)

    def expected(params, x, key):  # the same module written with flashport.attention
        m = eqx.combine(params, static)
        q, k, v = (
            jax.vmap(jax.vmap(p))(x).reshape(B, T, heads, -1)
            for p in (m.query_proj, m.key_proj, m.value_proj)
        )
        first = jax.random.split(jax.random.split(key, B)[0], heads)[0]
        out = flashport.attention(q, k, v, dropout_rate=0.2, dropout_rng=first)
        return jax.vmap(jax.vmap(m.output_proj))(out.reshape(B, T, -1))

    key = jax.random.key(4)
    assert count_sites(flashport.fuse_attention(f), params, x, key) == 0
    fused = flashport.fuse_attention(f, dropout="contract")
    assert count_sites(fused, params, x, key) == 1
    got, want = jax.jit(lambda p, xx: (fused(p, xx, key), expected(p, xx, key)))(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    w = jnp.cos(jnp.arange(got.size, dtype=jnp.float32)).reshape(got.shape)
    grads = [
        jax.jit(jax.grad(lambda p, xx, fn=fn: jnp.sum(fn(p, xx, key) * w), argnums=(0, 1)))(params, x)
        for fn in (fused, expected)
    ]
    for g, h in zip(*(jax.tree_util.tree_leaves(gr) for gr in grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), atol=1e-4, rtol=1e-4)


def test_keras_mha_with_dropout_in_training_fuses_only_with_the_opt_in():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras was imported with another backend before this test")
    e, heads = 16, 2
    layer = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=e // heads, dropout=0.1)
    x = jax.random.normal(jax.random.key(1), (B, T, e))
    layer(x, x)
    weights = [w.value for w in layer.trainable_variables]
    state = [w.value for w in layer.non_trainable_variables]  # the dropout seed generator's state

    def f(weights, x, state):
        return layer.stateless_call(weights, state, x, x, training=True)[0]

    assert count_sites(flashport.fuse_attention(f), weights, x, state) == 0
    (miss,) = flashport.find_attention(f)(weights, x, state).near_misses
    assert 'dropout="contract"' in miss.reason, miss.reason
    fused = flashport.fuse_attention(f, dropout="contract")
    assert count_sites(fused, weights, x, state) == 1
    (site,) = flashport.find_attention(f, dropout="contract")(weights, x, state).matches
    assert "dropout rate=0.1" in site.mask, site.mask
    plain = np.asarray(layer.stateless_call(weights, state, x, x, training=False)[0])
    got = np.asarray(fused(weights, x, state))
    assert np.all(np.isfinite(got)) and not np.allclose(got, plain, atol=1e-4)  # dropout is applied
