"""The drop-in for JAX's private cuDNN ``dot_product_attention`` against float64 references: padding
lengths (compared with ``jax.nn.dot_product_attention(..., implementation="xla")``, the stand-in for
``"cudnn"``, on the rows cuDNN computes), the lse residual's layout, scale 1.0, and the FPA202 port of
a MaxText-style function run without cuDNN."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashport import rules as registry
from flashport.integrations import jax_cudnn_compat as cudnn
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

FIXTURE = (
    pathlib.Path(__file__).parent / "fixtures" / "codemod" / "FPA202" / "padding_residual_splat_drop_in.py"
)


def _inputs(b=2, t=6, n=4, kn=2, h=8, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal(s).astype(np.float32) for s in ((b, t, n, h), (b, t, kn, h), (b, t, kn, h))
    )
    return q, k, v


def _reference(q, k, v, scale, visible):
    """float64 softmax attention, BTNH, GQA by contiguous groups; (out, lse [B, T, N])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    out = np.einsum("bnts,bsnh->btnh", p, v)
    lse = np.where(
        total[..., 0] > 0, np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)) + m[..., 0], -np.inf
    )
    return out, lse.transpose(0, 2, 1)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_lengths_and_residual_match_the_float64_reference_and_jax_nn(causal):
    q, k, v = _inputs()
    lengths = jnp.array([6, 4], jnp.int32)
    kind = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    out, lse = cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, mask_type=kind, scale=0.5, return_residual=True
    )
    t = np.arange(6)
    valid = t[None, :] < np.asarray(lengths)[:, None]
    visible = valid[:, None, :, None] & valid[:, None, None, :]
    if causal:
        visible = visible & (t[None, None, None, :] <= t[None, None, :, None])
    want_out, want_lse = _reference(q, k, v, 0.5, visible)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5)
    assert lse.shape == (2, 6, 4)  # BTN for the BTNH layout
    xla = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=0.5,
        is_causal=causal,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation="xla",
    )
    rows = valid[:, :, None, None]
    np.testing.assert_allclose(
        np.where(rows, np.asarray(out), 0), np.where(rows, np.asarray(xla), 0), atol=2e-5
    )


def test_bnth_layout_default_scale_and_window():
    q, k, v = _inputs(seed=1)
    tr = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731
    out, lse = cudnn.dot_product_attention(
        tr(q), tr(k), tr(v), qkv_layout="BNTH", sliding_window_length=2, return_residual=True
    )
    t = np.arange(6)
    visible = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - 2)
    want_out, want_lse = _reference(q, k, v, 1.0, visible[None, None])
    np.testing.assert_allclose(np.asarray(out), tr(want_out), atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.swapaxes(want_lse, 1, 2), atol=2e-5)


def test_unsupported_features_raise_naming_them():
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match="q_offsets"):
        cudnn.dot_product_attention(q, k, v, q_offsets=jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(NotImplementedError, match="ALIBI"):
        cudnn.dot_product_attention(q, k, v, mask_type=cudnn.MaskType.ALIBI)


def test_ported_maxtext_style_function_runs_without_cudnn():
    result = transform_source(FIXTURE.read_bytes(), FIXTURE.name, registry.all_rules(), RuleOptions())
    assert all(s.status == "rewrite" for s in result.sites), [s.reason for s in result.sites]
    code = result.new.decode()
    assert "jax._src.cudnn" not in code
    namespace: dict = {}
    exec(compile(code, "ported.py", "exec"), namespace)
    q, k, v = _inputs(seed=2)
    segments = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], jnp.int32)
    out, lse = namespace["attend"](q, k, v, segments, 0.0, True)
    t = np.arange(6)
    valid = t[None, :] < np.array([6, 3])[:, None]
    want_out, want_lse = _reference(q, k, v, 1.0, valid[:, None, :, None] & valid[:, None, None, :])
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5)
    causal, _ = namespace["attend"](q, k, v, segments, 0.0, False)
    want, _ = _reference(q, k, v, 1.0, (t[None, :] <= t[:, None])[None, None])
    np.testing.assert_allclose(np.asarray(causal), want, atol=2e-5)
    splat = namespace["forward"]({"query": q, "key": k, "value": v}, None, cudnn.MaskType.NO_MASK)
    np.testing.assert_allclose(
        np.asarray(splat), _reference(q, k, v, 1.0, np.ones((1, 1, 6, 6), bool))[0], atol=2e-5
    )
