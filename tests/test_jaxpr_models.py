"""The jaxpr pass on real library attention modules (small random configs, no downloads).

transformers' Flax models are in tests/test_jaxpr_transformers.py, dropout in tests/test_jaxpr_dropout.py.

Each test counts flashport_attention sites in ``jax.make_jaxpr(fused)(...)`` and checks output and
gradient parity (w.r.t. the parameters and the inputs) against the unmodified module.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import pytest
from jaxpr_util import assert_fused

import flashport

B, T, E, HEADS = 2, 16, 32, 4


def _x(seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, E))


@pytest.mark.parametrize("causal", [False, True])
def test_flax_linen_mha(causal):
    nn = pytest.importorskip("flax.linen")
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=E)
    x = _x()
    params = module.init(jax.random.PRNGKey(0), x, x)

    def f(params, x):
        mask = nn.make_causal_mask(x[..., 0]) if causal else None
        return module.apply(params, x, x, mask=mask)

    assert_fused(f, (params, x), 1, atol=1e-5)
    site = flashport.find_attention(f)(params, x).matches[0]
    assert site.mask == ("causal(bottom_right)" if causal else "none")


def test_flax_linen_mha_with_padding_mask_keeps_mean_rows():
    nn = pytest.importorskip("flax.linen")
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=E)
    x = _x()
    params = module.init(jax.random.PRNGKey(0), x, x)
    valid = jnp.arange(T)[None, :] < jnp.array([[10], [0]])  # batch 1: every key padded

    def f(params, x, valid):
        return module.apply(params, x, x, mask=nn.make_attention_mask(valid, valid))

    assert_fused(f, (params, x, valid), 1, argnums=(0, 1), atol=1e-5)


def test_flax_nnx_mha():
    nnx = pytest.importorskip("flax.nnx")
    module = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=E, qkv_features=E, decode=False, rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(module)

    def f(state, x):
        return nnx.merge(graphdef, state)(x, mask=nnx.make_causal_mask(x[..., 0]))

    assert_fused(f, (state, _x()), 1, atol=1e-5)


def test_equinox_mha():
    eqx = pytest.importorskip("equinox")
    module = eqx.nn.MultiheadAttention(num_heads=HEADS, query_size=E, key=jax.random.PRNGKey(2))
    params, static = eqx.partition(module, eqx.is_array)
    mask = jnp.tril(jnp.ones((T, T), bool))

    def f(params, x):
        m = eqx.combine(params, static)
        return jax.vmap(lambda xx: m(xx, xx, xx, mask=mask))(x)

    assert_fused(f, (params, _x()), 1, atol=1e-5)


def test_haiku_mha():
    hk = pytest.importorskip("haiku")

    def fwd(x):
        attn = hk.MultiHeadAttention(
            num_heads=HEADS, key_size=E // HEADS, w_init=hk.initializers.VarianceScaling(1.0)
        )
        return attn(x, x, x, mask=jnp.tril(jnp.ones((1, 1, T, T))))

    model = hk.without_apply_rng(hk.transform(fwd))
    x = _x()
    params = model.init(jax.random.PRNGKey(0), x)
    assert_fused(model.apply, (params, x), 1, atol=1e-5)


def test_keras_mha_jax_backend():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras was imported with another backend before this test")
    layer = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=E // HEADS)
    x = _x()
    layer(x, x)
    weights = [w.value for w in layer.trainable_variables]

    def f(weights, x):
        return layer.stateless_call(weights, [], x, x, use_causal_mask=True)[0]

    assert_fused(f, (weights, x), 1, atol=1e-5)
