"""transformers' Flax BERT-family attention, written out by hand, and P·V contracted in any dimension order.

transformers' Flax BERT/RoBERTa/ELECTRA attention is flax's ``dot_product_attention_weights`` (q
scaled by 1/sqrt(d), ``einsum("...qhd,...khd->...hqk")``, the padding mask as an additive
``finfo.min`` bias, softmax), then the head mask ``einsum("...hqk,h->...hqk")`` (all ones when the
caller passes none) and ``einsum("...hqk,...khd->...qhd", weights, value)``. Each case checks that
the site is fused and that outputs and gradients match the original program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jaxpr_util import assert_fused

import flashport

B, S, N, D = 2, 6, 3, 8
PAD = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])  # [B, S]: batch 0 has two padding tokens


def _qkv(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, (B, S, N, D)) for key in (kq, kk, kv))  # [B, S, N, D] like BERT


def _bias():
    m = PAD[:, None, None, :] > 0
    return jax.lax.select(m, jnp.zeros(m.shape), jnp.full(m.shape, jnp.finfo(jnp.float32).min))


def _weights(q, k):
    s = jnp.einsum("...qhd,...khd->...hqk", q / jnp.sqrt(D).astype(q.dtype), k)
    return jax.nn.softmax(s + _bias())


def bert_attention(q, k, v, head_mask=None):
    w = _weights(q, k)
    head_mask = jnp.ones((N,)) if head_mask is None else head_mask
    w = jnp.einsum("...hqk,h->...hqk", w, head_mask)
    return jnp.einsum("...hqk,...khd->...qhd", w, v)


def test_bert_family_attention_with_default_head_mask_is_fused():
    assert_fused(bert_attention, _qkv(), 1)
    (site,) = flashport.find_attention(bert_attention)(*_qkv()).matches
    assert site.mask.startswith("bias")


def test_bert_family_without_head_mask_is_fused():
    assert_fused(lambda q, k, v: jnp.einsum("...hqk,...khd->...qhd", _weights(q, k), v), _qkv(), 1)


def test_non_unit_head_mask_is_a_near_miss_with_the_reason():
    def f(q, k, v):
        return bert_attention(q, k, v, head_mask=jnp.array([1.0, 0.0, 1.0]))

    assert_fused(f, _qkv(), 0)
    (miss,) = flashport.find_attention(f)(*_qkv()).near_misses
    assert "not all ones" in miss.reason


# P·V written with every operand order and output order; p is [B, N, T, S], v is [B, S, N, D].
PV_EINSUMS = [
    "bhqk,bkhd->bqhd",
    "bhqk,bkhd->bhqd",
    "bhqk,bkhd->bdhq",
    "bhqk,bkhd->qbdh",
    "bkhd,bhqk->bqhd",
    "bkhd,bhqk->hdbq",
]


@pytest.mark.parametrize("spec", PV_EINSUMS)
def test_pv_einsum_in_any_dimension_order_is_fused(spec):
    def f(q, k, v):
        w = _weights(q, k)
        a, _b = spec.split("->")[0].split(",")
        return jnp.einsum(spec, *((w, v) if a.startswith("bh") else (v, w)))

    assert_fused(f, _qkv(), 1)


@pytest.mark.parametrize("p_lhs", [True, False])
@pytest.mark.parametrize("batch_order", [(0, 1), (1, 0)])
def test_pv_dot_general_with_permuted_batch_dims_is_fused(p_lhs, batch_order):
    def f(q, k, v):
        w = _weights(q, k)  # [B, N, T, S]
        pb = tuple((0, 1)[i] for i in batch_order)
        vb = tuple((0, 2)[i] for i in batch_order)
        if p_lhs:
            dims = (((3,), (1,)), (pb, vb))
            return jax.lax.dot_general(w, v, dims)
        dims = (((1,), (3,)), (vb, pb))
        return jax.lax.dot_general(v, w, dims)

    assert_fused(f, _qkv(), 1)


def test_flax_dot_product_attention_weights_then_einsum_is_fused():
    attention = pytest.importorskip("flax.linen.attention")

    def f(q, k, v):
        w = attention.dot_product_attention_weights(q, k, bias=_bias(), deterministic=True)
        return jnp.einsum("...hqk,...khd->...qhd", jnp.einsum("...hqk,h->...hqk", w, jnp.ones((N,))), v)

    assert_fused(f, _qkv(), 1)
