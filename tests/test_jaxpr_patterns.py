"""Hand-written attention variants the jaxpr pass must fuse, and negative twins it must leave alone.

Every positive checks the number of flashport_attention sites, output parity with the original
function and gradient parity; every negative checks that nothing is fused, that the near-miss
report gives a reason, and that the fused function still returns the original values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import assert_fused, count_sites

import flashport

B, T, S, N, H = 2, 8, 8, 4, 8
SCALE = 1.0 / math.sqrt(H)


def _qkv(t=T, s=S, n=N, kn=None, h=H, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    kn = n if kn is None else kn
    q = jax.random.normal(kq, (B, t, n, h), dtype) * 1.5
    k = jax.random.normal(kk, (B, s, kn, h), dtype) * 1.5
    v = jax.random.normal(kv, (B, s, kn, h), dtype)
    return q, k, v


def _causal(t=T, s=S):
    return jnp.tril(jnp.ones((t, s), bool))


def _sm(s):
    return jax.nn.softmax(s, axis=-1)


def _manual_sm(s):
    e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    return e * (1.0 / jnp.sum(e, axis=-1, keepdims=True))


# name -> (fn(q, k, v), kwargs for _qkv)
POSITIVE = {
    "einsum_mul_scale": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE), v
    ),
    "einsum_div_sqrt_traced": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(H)), v
    ),
    "scale_on_q_before_dot": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q / math.sqrt(H), k)), v
    ),
    "scale_on_k": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k * SCALE)), v
    ),
    "no_scale": lambda q, k, v: jnp.einsum("bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k)), v),
    "matmul_bnth": lambda q, k, v: (
        _sm((q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)) * SCALE) @ v.transpose(0, 2, 1, 3)
    ),
    "seq_first": lambda q, k, v: jnp.einsum(
        "bnts,sbnh->tbnh",
        _sm(jnp.einsum("tbnh,sbnh->bnts", q.transpose(1, 0, 2, 3), k.transpose(1, 0, 2, 3)) * SCALE),
        v.transpose(1, 0, 2, 3),
    ),
    "scores_btsn_softmax_axis2": lambda q, k, v: jnp.einsum(
        "btsn,bsnh->btnh", jax.nn.softmax(jnp.einsum("btnh,bsnh->btsn", q, k) * SCALE, axis=2), v
    ),
    "manual_softmax_recip": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _manual_sm(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE), v
    ),
    "exp_minus_logsumexp": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        jnp.exp(
            (s := jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE) - jax.nn.logsumexp(s, axis=-1, keepdims=True)
        ),
        v,
    ),
    "exp_log_softmax": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        jnp.exp(jax.nn.log_softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE, axis=-1)),
        v,
    ),
    "causal_tril_where_neg_inf": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.where(_causal(), jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE, -jnp.inf)), v
    ),
    "causal_finfo_min": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(jnp.where(_causal(), jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE, jnp.finfo(jnp.float32).min)),
        v,
    ),
    "causal_arange_ge": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(
            jnp.where(
                jnp.arange(T)[:, None] >= jnp.arange(S)[None, :],
                jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE,
                -1e9,
            )
        ),
        v,
    ),
    "causal_broadcasted_iota": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(
            jnp.where(
                jax.lax.broadcasted_iota(jnp.int32, (B, N, T, S), 2)
                >= jax.lax.broadcasted_iota(jnp.int32, (B, N, T, S), 3),
                jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE,
                -1e30,
            )
        ),
        v,
    ),
    "mask_before_scale": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.where(_causal(), jnp.einsum("btnh,bsnh->bnts", q, k), -1e9) * SCALE), v
    ),
    "window_and_causal": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(
            jnp.where(
                _causal() & (jnp.arange(T)[:, None] - jnp.arange(S)[None, :] < 3),
                jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE,
                -1e9,
            )
        ),
        v,
    ),
    "triu_additive_bias": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE + jnp.triu(jnp.full((T, S), -1e9), k=1)),
        v,
    ),
    "softcap_tanh": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(5.0 * jnp.tanh(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE / 5.0)), v
    ),
    "softmax_where": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE, axis=-1, where=_causal()),
        v,
    ),
    "keras_style_post_mask": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        jnp.where(
            _causal(), _sm(jnp.where(_causal(), jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE, -1e9)), 0.0
        ),
        v,
    ),
    "f32_upcast_bf16": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(
            jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)).astype(jnp.float32)
            * SCALE
        ).astype(jnp.bfloat16),
        v.astype(jnp.bfloat16),
    ).astype(jnp.float32),
    "only_softmax_jitted": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", jax.jit(_sm)(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE), v
    ),
    "single_head_2d_vmapped": lambda q, k, v: jax.vmap(
        jax.vmap(lambda a, b, c: _sm(a @ b.T * SCALE) @ c, in_axes=(1, 1, 1), out_axes=1)
    )(q, k, v),
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_positive_variant_fuses_with_parity(name):
    q, k, v = _qkv()
    assert_fused(
        POSITIVE[name],
        (q, k, v),
        1,
        atol=3e-2 if "bf16" in name else 2e-5,
        rtol=3e-2 if "bf16" in name else 2e-5,
    )


def test_causal_is_recognized_not_materialized():
    rep = flashport.find_attention(POSITIVE["causal_arange_ge"])(*_qkv())
    assert [s.mask for s in rep.matches] == ["causal(bottom_right)"]
    rep = flashport.find_attention(POSITIVE["window_and_causal"])(*_qkv())
    assert rep.matches[0].mask == "causal(bottom_right), window(2, None)(bottom_right)"


def test_decode_alignment_bottom_right_and_top_left():
    q, k, v = _qkv(t=4, s=8)
    br = jnp.arange(4)[:, None] + 4 >= jnp.arange(8)[None, :]
    tl = jnp.arange(4)[:, None] >= jnp.arange(8)[None, :]
    for m, align in ((br, "bottom_right"), (tl, "top_left")):

        def f(q, k, v, m=m):
            return jnp.einsum(
                "bnts,bsnh->btnh", _sm(jnp.where(m, jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE, -1e9)), v
            )

        rep = flashport.find_attention(f)(q, k, v)
        assert rep.matches[0].mask == f"causal({align})"
        assert_fused(f, (q, k, v), 1)


def test_bias_then_scale_scales_the_bias():
    q, k, v = _qkv()
    bias = jax.random.normal(jax.random.PRNGKey(5), (1, N, T, S))

    def f(q, k, v, bias):
        return jnp.einsum("bnts,bsnh->btnh", _sm((jnp.einsum("btnh,bsnh->bnts", q, k) + bias) * SCALE), v)

    assert_fused(f, (q, k, v, bias), 1)


def test_generic_boolean_and_padding_masks_with_mean_rows_preserved():
    q, k, v = _qkv()
    lengths = jnp.array([5, 0])  # batch 1 has no valid key: every row is fully masked
    pad = jnp.arange(S)[None, :] < lengths[:, None]  # [B, S]

    def f(q, k, v, pad):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
        s = jnp.where(pad[:, None, None, :], s, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bnts,bsnh->btnh", _sm(s), v)

    fused = assert_fused(f, (q, k, v, pad), 1, argnums=(0, 1, 2))
    # original semantics: mean of V over all keys in the fully masked batch
    np.testing.assert_allclose(fused(q, k, v, pad)[1], jnp.broadcast_to(v[1].mean(0), (T, N, H)), atol=1e-6)


def test_fully_masked_rows_neg_inf_stay_nan_and_softmax_where_gives_zero():
    q, k, v = _qkv(t=8, s=4)
    m = jnp.arange(8)[:, None] - 4 >= jnp.arange(4)[None, :]  # rows 0..3 see nothing

    def f_inf(q, k, v):
        return jnp.einsum(
            "bnts,bsnh->btnh", _sm(jnp.where(m, jnp.einsum("btnh,bsnh->bnts", q, k), -jnp.inf)), v
        )

    def f_where(q, k, v):
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), where=m), v)

    for f in (f_inf, f_where):
        fused = flashport.fuse_attention(f)
        assert count_sites(fused, q, k, v) == 1
        np.testing.assert_allclose(fused(q, k, v), f(q, k, v), atol=2e-5)  # NaNs compare equal
    assert np.isnan(flashport.fuse_attention(f_inf)(q, k, v)[:, :4]).all()


def test_gqa_repeat_and_grouped_einsum_and_mqa():
    q, k, v = _qkv(kn=2)

    def repeat(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        return jnp.einsum("bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE), v)

    def grouped(q, k, v):
        qg = q.reshape(B, T, 2, 2, H)
        s = jnp.einsum("btkgh,bskh->bkgts", qg, k) * SCALE
        return jnp.einsum("bkgts,bskh->btkgh", _sm(s), v).reshape(B, T, N, H)

    assert_fused(repeat, (q, k, v), 1)
    assert_fused(grouped, (q, k, v), 1)
    assert flashport.find_attention(grouped)(q, k, v).matches[0].gqa == 2
    q1, k1, v1 = q, k[:, :, 0], v[:, :, 0]

    def mqa(q, k, v):
        return jnp.einsum("bnts,bsh->btnh", _sm(jnp.einsum("btnh,bsh->bnts", q, k) * SCALE), v)

    assert_fused(mqa, (q1, k1, v1), 1)
    assert flashport.find_attention(mqa)(q1, k1, v1).matches[0].gqa == N


def test_jax_nn_dot_product_attention_variants():
    q, k, v = _qkv(kn=2)
    assert_fused(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), (q, k, v), 1)
    assert_fused(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), (q, k, v), 1)
    assert_fused(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, local_window_size=(2, 0)), (q, k, v), 1
    )
    rep = flashport.find_attention(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, local_window_size=(2, 1))
    )(q, k, v)
    assert (
        rep.matches[0].mask == "window(2, 1)(top_left)" or rep.matches[0].mask == "window(2, 1)(bottom_right)"
    )


def _p_returned(q, k, v):
    p = _sm(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE)
    return jnp.einsum("bnts,bsnh->btnh", p, v), p


def _dropout(q, k, v):
    p = _sm(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE)
    keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.9, p.shape)
    return jnp.einsum("bnts,bsnh->btnh", jnp.where(keep, p / 0.9, 0.0), v)


NEGATIVE = {
    "softmax_over_query_axis": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=2), v
    ),
    "softmax_over_both_axes": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=(2, 3)), v
    ),
    "pv_contracts_query_axis": lambda q, k, v: jnp.einsum(
        "bnts,btnh->bsnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k)), v
    ),
    "exp_minus_sum": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        (e := jnp.exp((s := jnp.einsum("btnh,bsnh->bnts", q, k)) - s.sum(-1, keepdims=True)))
        / e.sum(-1, keepdims=True),
        v,
    ),
    "max_wrong_axis": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        (e := jnp.exp((s := jnp.einsum("btnh,bsnh->bnts", q, k)) - s.max(2, keepdims=True)))
        / e.sum(-1, keepdims=True),
        v,
    ),
    "sum_wrong_axis": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        (e := jnp.exp((s := jnp.einsum("btnh,bsnh->bnts", q, k)) - s.max(-1, keepdims=True)))
        / e.sum(2, keepdims=True),
        v,
    ),
    "normalize_without_exp": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", (s := jnp.abs(jnp.einsum("btnh,bsnh->bnts", q, k))) / s.sum(-1, keepdims=True), v
    ),
    "sigmoid_attention": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", jax.nn.sigmoid(jnp.einsum("btnh,bsnh->bnts", q, k)), v
    ),
    "p_returned": _p_returned,
    "entropy_reuse": lambda q, k, v: (
        lambda p: (jnp.einsum("bnts,bsnh->btnh", p, v), -(p * jnp.log(p + 1e-9)).sum())
    )(_sm(jnp.einsum("btnh,bsnh->bnts", q, k))),
    "post_mask_without_renormalisation": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k)) * _causal(), v
    ),
    "dropout": _dropout,
    "no_pv_dot": lambda q, k, v: _sm(jnp.einsum("btnh,bsnh->bnts", q, k)).sum(-1),
    "p_squared": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.einsum("btnh,bsnh->bnts", q, k)) ** 2, v
    ),
    "l2_distance_scores": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(-((q.transpose(0, 2, 1, 3)[:, :, :, None] - k.transpose(0, 2, 1, 3)[:, :, None]) ** 2).sum(-1)),
        v,
    ),
    "fill_not_negative_enough": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _sm(jnp.where(_causal(), jnp.einsum("btnh,bsnh->bnts", q, k), -10.0)), v
    ),
    "softcap_after_mask": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        _sm(5.0 * jnp.tanh(jnp.where(_causal(), jnp.einsum("btnh,bsnh->bnts", q, k), -1e9) / 5.0)),
        v,
    ),
    "post_mask_differs": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh",
        jnp.where(_causal().T, _sm(jnp.where(_causal(), jnp.einsum("btnh,bsnh->bnts", q, k), -1e9)), 0.0),
        v,
    ),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_twin_is_not_fused(name):
    q, k, v = _qkv()
    f = NEGATIVE[name]
    fused = flashport.fuse_attention(f)
    assert count_sites(fused, q, k, v) == 0
    for w, g in zip(
        jax.tree_util.tree_leaves(f(q, k, v)), jax.tree_util.tree_leaves(fused(q, k, v)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    rep = flashport.find_attention(f)(q, k, v)
    assert not rep.matches
    assert all(s.reason for s in rep.near_misses)


@pytest.mark.parametrize(
    "name,reason",
    [
        ("softmax_over_query_axis", "PV product does not contract"),
        ("max_wrong_axis", "different axes"),
        ("sum_wrong_axis", "different axes"),
        ("p_returned", "other users"),
        ("entropy_reuse", "other users"),
        ("dropout", 'dropout="contract"'),
        ("fill_not_negative_enough", "not negative enough"),
        ("softcap_after_mask", "softcap must come before"),
        ("post_mask_differs", "post-softmax mask differs"),
        ("exp_minus_sum", "not the row max"),
    ],
)
def test_near_miss_reasons(name, reason):
    rep = flashport.find_attention(NEGATIVE[name])(*_qkv())
    assert any(reason in s.reason for s in rep.near_misses), rep.to_dicts()
