"""flashport.integrations.transformer_engine_flax.DotProductAttention and
transformer_engine_compat.fused_attn against TransformerEngine's documented semantics, written out
here in float64 (the visible-key matrix of each mask type, layout and window) and fed to the float64
reference as an explicit mask."""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from reference import reference_attention

from flashport.integrations.transformer_engine_compat import (
    AttnBiasType,
    AttnMaskType,
    QKVLayout,
    SequenceDescriptor,
    fused_attn,
)
from flashport.integrations.transformer_engine_flax import DotProductAttention

B, SQ, SK, HQ, HKV, D = 2, 6, 9, 4, 2, 8
TOL = dict(rtol=2e-5, atol=2e-5)  # float32 on CPU vs float64: measured max error ~1e-6


def inputs(sq=SQ, sk=SK, hq=HQ, hkv=HKV, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, sq, hq, D)).astype(np.float32)
    k = rng.standard_normal((B, sk, hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, sk, hkv, D)).astype(np.float32)
    return q, k, v


def padding_mask(sq, sk, q_len=(4, 6), kv_len=(5, 9)):
    """TE's convention: True = masked out, [b, 1, sq, sk]; row b keeps q < q_len[b], k < kv_len[b]."""
    mask = np.ones((B, 1, sq, sk), bool)
    for b in range(B):
        mask[b, 0, : min(q_len[b], sq), : min(kv_len[b], sk)] = False
    return mask


def te_visible(mask_type, sq, sk, masked_out=None, window=None):
    """Which key each query sees, from TE's definitions: 'causal' keeps j <= i, the bottom-right types
    j <= i + sk - sq; padding types drop what the mask marks True; a window (l, r) keeps
    [i - l, i + r] around the same diagonal (negative = unbounded). [b, 1, sq, sk] bool."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    offset = sk - sq if "bottom_right" in mask_type else 0
    keep = np.ones((sq, sk), bool)
    if "causal" in mask_type:
        keep &= j <= i + offset
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i + offset - left
        if right >= 0:
            keep &= j <= i + offset + right
    keep = np.broadcast_to(keep, (B, 1, sq, sk))
    if "padding" in mask_type and masked_out is not None:
        keep = keep & ~np.broadcast_to(masked_out, (B, 1, sq, sk))
    return keep


def expected(q, k, v, keep, scale=None, bias=None):
    out, _ = reference_attention(q, k, v, scale=scale, mask=keep, bias=bias, layout="BSHD")
    return out


def run(module, *args, **kwargs):
    return np.asarray(module.apply({}, *args, **kwargs))


def assert_close_where_seen(out, want, keep):
    """Compare rows that see at least one key (TE leaves other rows as padding; the contract gives 0)."""
    seen = np.broadcast_to(keep.any(-1), (B, keep.shape[1], keep.shape[2]))[:, 0]  # [b, sq]
    np.testing.assert_allclose(out[seen], want[seen], **TOL)


def te(**fields):
    fields.setdefault("transpose_batch_sequence", False)
    return DotProductAttention(head_dim=D, num_attention_heads=HQ, num_gqa_groups=HKV, **fields)


MASK_TYPES = [
    "no_mask",
    "causal",
    "causal_bottom_right",
    "padding",
    "padding_causal",
    "causal_padding",
]


@pytest.mark.parametrize("mask_type", MASK_TYPES)
@pytest.mark.parametrize(("sq", "sk"), [(SQ, SK), (7, 7), (SK, SQ)])
def test_mask_types_gqa(mask_type, sq, sk):
    """Every mask type, with a padding mask passed (ignored by the non-padding types), GQA heads."""
    q, k, v = inputs(sq, sk)
    masked_out = padding_mask(sq, sk)
    out = run(te(attn_mask_type=mask_type), q, k, v, masked_out)
    keep = te_visible(mask_type, sq, sk, masked_out)
    assert_close_where_seen(out, expected(q, k, v, keep), keep)


@pytest.mark.parametrize("as_uint8", [False, True])
def test_mask_keyword_uint8_and_five_dim(as_uint8):
    """MaxText passes a uint8 mask (1 = masked out) of shape [b, 1, 1, sq, sk] as sequence_descriptor=."""
    q, k, v = inputs(SQ, SQ)
    masked_out = padding_mask(SQ, SQ)
    keep = te_visible("padding_causal", SQ, SQ, masked_out)
    five = masked_out[:, :, None].astype(np.uint8 if as_uint8 else bool)
    module = te(attn_mask_type="padding_causal", scale_factor=1.0)
    out = run(module, q, k, v, sequence_descriptor=five)
    assert_close_where_seen(out, expected(q, k, v, keep, scale=1.0), keep)
    np.testing.assert_array_equal(run(module, q, k, v, mask=five), out)


def test_no_mask_layout_of_maxdiffusion():
    """MaxDiffusion: MHA, 'no_mask', upper-case bias type and layout, the module applied with {}."""
    q, k, v = inputs(SQ, SK, hq=HQ, hkv=HQ)
    module = DotProductAttention(
        head_dim=D,
        num_attention_heads=HQ,
        num_gqa_groups=HQ,
        attn_mask_type="no_mask",
        attn_bias_type="NO_BIAS",
        dropout_rng_name="aqt",
        dtype=jnp.float32,
        qkv_layout="BSHD_BSHD_BSHD",
        scale_factor=0.3,
        transpose_batch_sequence=False,
    )
    out = np.asarray(functools.partial(module.apply, {})(q, k, v, mask=None))
    keep = te_visible("no_mask", SQ, SK)
    np.testing.assert_allclose(out, expected(q, k, v, keep, scale=0.3), **TOL)


@pytest.mark.parametrize("layout", ["bs3hd", "BSHD_BS2HD", "bshd_bshd_bshd"])
@pytest.mark.parametrize("transpose", [False, True])
def test_packed_layouts_and_sequence_first(layout, transpose):
    q, k, v = inputs(SQ, SQ, hq=HQ, hkv=HQ)
    keep = te_visible("causal", SQ, SQ)
    want = expected(q, k, v, keep)
    if layout == "bs3hd":
        args = (np.stack([q, k, v], axis=2), None, None)
    elif layout == "BSHD_BS2HD":
        args = (q, np.stack([k, v], axis=2), None)
    else:
        args = (q, k, v)
    if transpose:
        args = tuple(None if a is None else np.swapaxes(a, 0, 1) for a in args)
    module = te(qkv_layout=layout, attn_mask_type="causal", transpose_batch_sequence=transpose)
    out = run(module, *args)
    if transpose:
        out = np.swapaxes(out, 0, 1)
    np.testing.assert_allclose(out, want, **TOL)


def test_packed_layout_default_scale_uses_head_dim_field():
    """Packed layouts scale by 1/sqrt(head_dim) from the field (TE reads no tensor for it)."""
    q, k, v = inputs(SQ, SQ, hq=HQ, hkv=HQ)
    module = DotProductAttention(
        head_dim=2 * D,
        num_attention_heads=HQ,
        attn_mask_type="no_mask",
        qkv_layout="bs3hd",
        transpose_batch_sequence=False,
    )
    out = run(module, np.stack([q, k, v], axis=2), None, None)
    np.testing.assert_allclose(
        out, expected(q, k, v, te_visible("no_mask", SQ, SQ), scale=1 / np.sqrt(2 * D)), **TOL
    )


@pytest.mark.parametrize(
    ("mask_type", "window", "sq", "sk"),
    [
        ("causal", (2, 0), SQ, SQ),
        ("causal", (3, 0), SQ, SK),
        ("no_mask", (2, 1), SQ, SK),
        ("causal_bottom_right", (2, 0), SQ, SK),
        ("padding_causal", (1, -1), SQ, SK),
        ("no_mask", (-1, -1), SQ, SK),
    ],
)
def test_window(mask_type, window, sq, sk):
    q, k, v = inputs(sq, sk)
    masked_out = padding_mask(sq, sk)
    out = run(te(attn_mask_type=mask_type, window_size=window), q, k, v, masked_out)
    keep = te_visible(mask_type, sq, sk, masked_out, window=window)
    assert_close_where_seen(out, expected(q, k, v, keep), keep)


@pytest.mark.parametrize("bias_type", [None, "post_scale_bias", "PRE_SCALE_BIAS"])
def test_bias_types(bias_type):
    q, k, v = inputs(SQ, SK)
    bias = np.random.default_rng(7).standard_normal((1, HQ, SQ, SK)).astype(np.float32)
    out = run(te(attn_mask_type="no_mask", attn_bias_type=bias_type, scale_factor=0.5), q, k, v, None, bias)
    added = bias * 0.5 if bias_type == "PRE_SCALE_BIAS" else bias  # softmax(scale * (qk + bias))
    keep = te_visible("no_mask", SQ, SK)
    np.testing.assert_allclose(out, expected(q, k, v, keep, scale=0.5, bias=added), **TOL)


def test_bias_type_and_bias_must_agree():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="attn_bias_type='no_bias'"):
        run(te(attn_bias_type="no_bias"), q, k, v, None, np.zeros((1, HQ, SQ, SK), np.float32))


def test_dropout_draws_from_the_named_rng_only_when_not_deterministic():
    q, k, v = inputs()
    keep = te_visible("causal", SQ, SK)
    module = te(attention_dropout=0.5, dropout_rng_name="aqt")
    plain = expected(q, k, v, keep)
    np.testing.assert_allclose(run(module, q, k, v, deterministic=True), plain, **TOL)
    first = run(module, q, k, v, rngs={"aqt": jax.random.key(1)})
    again = run(module, q, k, v, rngs={"aqt": jax.random.key(1)})
    other = run(module, q, k, v, rngs={"aqt": jax.random.key(2)})
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - plain).max() > 1e-2 and np.abs(first - other).max() > 1e-2
    with pytest.raises(Exception, match="aqt"):
        run(module, q, k, v)


def test_runs_under_nnx_bridge_like_maxtext():
    """MaxText wraps the module with nnx's ToNNX, lazy_inits it on zeros and calls it."""
    nnx = pytest.importorskip("flax.nnx")
    q, k, v = inputs(SQ, SQ)
    masked_out = padding_mask(SQ, SQ).astype(np.uint8)[:, :, None]
    layer = nnx.bridge.ToNNX(te(attn_mask_type="padding_causal", scale_factor=1.0), rngs=nnx.Rngs(0))
    layer.lazy_init(jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), sequence_descriptor=masked_out)
    out = np.asarray(layer(q, k, v, sequence_descriptor=masked_out, deterministic=True))
    keep = te_visible("padding_causal", SQ, SQ, masked_out[:, :, 0].astype(bool))
    assert_close_where_seen(out, expected(q, k, v, keep, scale=1.0), keep)


class _SequenceDescriptorLike:
    """Stands for TE's own SequenceDescriptor class: no array."""


@pytest.mark.parametrize(
    ("fields", "call", "message"),
    [
        ({"qkv_layout": "thd_thd_thd"}, {}, "qkv_layout='thd_thd_thd'"),
        (
            {"attn_mask_type": "padding_causal", "qkv_layout": "THD_THD_THD"},
            {"sequence_descriptor": SequenceDescriptor.from_seqlens(np.array([3, 4]))},
            "qkv_layout='THD_THD_THD'",
        ),
        (
            {"attn_mask_type": "padding_causal"},
            {
                "sequence_descriptor": SequenceDescriptor.from_seqlens_and_offsets(
                    np.zeros((2, 2)), np.zeros((2, 3))
                )
            },
            "from_seqlens_and_offsets",
        ),
        (
            {"attn_mask_type": "padding_causal_bottom_right"},
            {"mask": np.zeros((B, 1, SQ, SK), bool)},
            "padding_causal_bottom_right",
        ),
        ({"softmax_type": "off-by-one"}, {}, "softmax_type='off-by-one'"),
        ({"score_mod": lambda s: s}, {}, "score_mod="),
        ({}, {"score_mod_tensors": {}}, "score_mod_tensors="),
        (
            {"attn_mask_type": "padding"},
            {"sequence_descriptor": _SequenceDescriptorLike()},
            "SequenceDescriptor",
        ),
        (
            {"context_parallel_causal_load_balanced": True, "context_parallel_axis": "context"},
            {},
            "context_parallel_causal_load_balanced=True",
        ),
    ],
)
def test_unsupported_configurations_raise_naming_the_argument(fields, call, message):
    q, k, v = inputs()
    with pytest.raises(NotImplementedError, match=message.replace("(", r"\(").replace("=", "=")):
        run(te(**fields), q, k, v, **call)


def test_load_balanced_flag_is_inert_without_a_context_parallel_axis():
    q, k, v = inputs()
    keep = te_visible("causal", SQ, SK)
    out = run(te(context_parallel_causal_load_balanced=True, context_parallel_axis=""), q, k, v)
    np.testing.assert_allclose(out, expected(q, k, v, keep), **TOL)


def test_unknown_mask_type_is_a_value_error():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="attn_mask_type='Causal'"):
        run(te(attn_mask_type="Causal"), q, k, v)


def test_padding_bottom_right_without_a_mask_is_plain_bottom_right_causal():
    q, k, v = inputs()
    keep = te_visible("causal_bottom_right", SQ, SK)
    out = run(te(attn_mask_type="padding_causal_bottom_right"), q, k, v)
    np.testing.assert_allclose(out, expected(q, k, v, keep), **TOL)


# ------------------------------------------------------------------------- SequenceDescriptor


def te_segment_visible(mask_type, q_ids, kv_ids, q_pos, kv_pos, window=None):
    """TE's make_mask (its fused-attention tests): equal non-zero segment ids; causal and window by
    segment position. [b, 1, sq, sk] bool (True = attend)."""
    b, sq = q_ids.shape
    sk = kv_ids.shape[1]
    keep = np.zeros((b, 1, sq, sk), bool)
    for r in range(b):
        for i in range(sq):
            for j in range(sk):
                ok = q_ids[r, i] == kv_ids[r, j] and q_ids[r, i] != 0
                if "causal" in mask_type:
                    ok = ok and q_pos[r, i] >= kv_pos[r, j]
                if window is not None:
                    left, right = window
                    ok = ok and (left < 0 or kv_pos[r, j] >= q_pos[r, i] - left)
                    ok = ok and (right < 0 or kv_pos[r, j] <= q_pos[r, i] + right)
                keep[r, 0, i, j] = ok
    return keep


# TE's docstring examples: three segments packed with trailing padding; intra-segment padding
SEGMENT_IDS = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 0, 0], [1, 1, 1, 2, 2, 3, 3, 3, 0, 0, 4, 4]], np.int32)
SEGMENT_POS = np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 0], [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1]], np.int32)


@pytest.mark.parametrize("layout", ["bshd_bshd_bshd", "thd_thd_thd"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_segment_ids_and_positions(layout, mask_type, window):
    s = SEGMENT_IDS.shape[1]
    q, k, v = inputs(s, s)
    descriptor = SequenceDescriptor.from_segment_ids_and_pos(SEGMENT_IDS, segment_pos=SEGMENT_POS)
    module = te(attn_mask_type=mask_type, qkv_layout=layout, window_size=window, scale_factor=1.0)
    out = run(module, q, k, v, sequence_descriptor=descriptor)
    keep = te_segment_visible(mask_type, SEGMENT_IDS, SEGMENT_IDS, SEGMENT_POS, SEGMENT_POS, window)
    assert_close_where_seen(out, expected(q, k, v, keep, scale=1.0), keep)


def test_segment_positions_in_load_balanced_order():
    """Context parallelism's load-balanced order permutes the tokens; causal follows the positions, so
    the output is the permuted output of the natural order."""
    s = SEGMENT_IDS.shape[1]
    q, k, v = inputs(s, s)
    order = np.array([0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7])
    module = te(
        attn_mask_type="padding_causal",
        qkv_layout="thd_thd_thd",
        context_parallel_causal_load_balanced=True,
        context_parallel_axis="context",
    )
    natural = SequenceDescriptor.from_segment_ids_and_pos(SEGMENT_IDS, SEGMENT_POS)
    permuted = SequenceDescriptor.from_segment_ids_and_pos(SEGMENT_IDS[:, order], SEGMENT_POS[:, order])
    want = run(module, q, k, v, sequence_descriptor=natural)[:, order]
    got = run(module, q[:, order], k[:, order], v[:, order], sequence_descriptor=permuted)
    np.testing.assert_allclose(got, want, **TOL)


def test_seqlens_descriptor_is_right_padding():
    q, k, v = inputs(SQ, SK)
    q_len, kv_len = np.array([4, 6]), np.array([5, 9])
    descriptor = SequenceDescriptor.from_seqlens((q_len, kv_len))
    out = run(te(attn_mask_type="padding_causal"), q, k, v, descriptor)
    keep = te_visible("padding_causal", SQ, SK, padding_mask(SQ, SK, q_len, kv_len))
    assert_close_where_seen(out, expected(q, k, v, keep), keep)


def test_descriptor_is_a_pytree_through_jit():
    s = SEGMENT_IDS.shape[1]
    q, k, v = inputs(s, s)
    module = te(attn_mask_type="padding_causal", qkv_layout="thd_thd_thd")
    descriptor = SequenceDescriptor.from_segment_ids_and_pos(SEGMENT_IDS, SEGMENT_POS)
    eager = run(module, q, k, v, descriptor)
    jitted = np.asarray(jax.jit(lambda d: module.apply({}, q, k, v, d))(descriptor))
    np.testing.assert_allclose(jitted, eager, **TOL)


def test_segment_factory_needs_positions_and_takes_no_older_keywords():
    """TE 2.18 requires segment_pos; MaxText retries without is_thd= on the TypeError."""
    with pytest.raises(ValueError, match="segment_pos is now required"):
        SequenceDescriptor.from_segment_ids_and_pos(SEGMENT_IDS)
    with pytest.raises(TypeError):
        SequenceDescriptor.from_segment_ids_and_pos(SEGMENT_IDS, segment_pos=SEGMENT_POS, is_thd=True)


# ------------------------------------------------------------------------------- fused_attn


MEMBERS = {
    "no_mask": "NO_MASK",
    "causal": "CAUSAL_MASK",
    "causal_bottom_right": "CAUSAL_BOTTOM_RIGHT_MASK",
    "padding": "PADDING_MASK",
    "padding_causal": "PADDING_CAUSAL_MASK",
}


def te_fused(qkv, mask, mask_type, layout="BSHD_BSHD_BSHD", **kwargs):
    """A levanter-style keyword call of TE 2.0's fused_attn."""
    options = dict(
        bias=None,
        seed=None,
        attn_bias_type=AttnBiasType.NO_BIAS,
        scaling_factor=0.3,
        dropout_probability=0.0,
        is_training=False,
    )
    options.update(kwargs)
    return np.asarray(
        fused_attn(
            qkv=qkv,
            mask=mask,
            attn_mask_type=AttnMaskType[MEMBERS[mask_type]],
            qkv_layout=QKVLayout[layout],
            **options,
        )
    )


@pytest.mark.parametrize("mask_type", list(MEMBERS))
@pytest.mark.parametrize(("sq", "sk"), [(SQ, SK), (7, 7)])
def test_fused_attn_mask_types_gqa(mask_type, sq, sk):
    q, k, v = inputs(sq, sk)
    masked_out = padding_mask(sq, sk)
    out = te_fused((q, k, v), masked_out, mask_type)
    keep = te_visible(mask_type, sq, sk, masked_out)
    assert_close_where_seen(out, expected(q, k, v, keep, scale=0.3), keep)


def test_fused_attn_ignores_levanters_placeholder_masks():
    """levanter passes ones (all masked out, were it read) with NO_MASK and a [sq, sk, b] stack with
    CAUSAL_MASK: TE reads the mask for the padding types only."""
    q, k, v = inputs(SQ, SQ)
    for mask_type, mask in (("no_mask", np.ones((B, SQ, SQ))), ("causal", np.ones((SQ, SQ, B), bool))):
        keep = te_visible(mask_type, SQ, SQ)
        np.testing.assert_allclose(
            te_fused((q, k, v), mask, mask_type), expected(q, k, v, keep, scale=0.3), **TOL
        )


@pytest.mark.parametrize("layout", ["BS3HD", "BSHD_BS2HD"])
def test_fused_attn_packed_layouts(layout):
    q, k, v = inputs(SQ, SQ, hq=HQ, hkv=HQ)
    qkv = (np.stack([q, k, v], axis=2),) if layout == "BS3HD" else (q, np.stack([k, v], axis=2))
    keep = te_visible("causal", SQ, SQ)
    out = te_fused(qkv, None, "causal", layout=layout)
    np.testing.assert_allclose(out, expected(q, k, v, keep, scale=0.3), **TOL)


def test_fused_attn_bias_types():
    q, k, v = inputs()
    bias = np.random.default_rng(3).standard_normal((1, HQ, SQ, SK)).astype(np.float32)
    keep = te_visible("no_mask", SQ, SK)
    for kind, added in (("POST_SCALE_BIAS", bias), ("PRE_SCALE_BIAS", bias * 0.3)):
        out = te_fused((q, k, v), None, "no_mask", bias=bias, attn_bias_type=AttnBiasType[kind])
        np.testing.assert_allclose(out, expected(q, k, v, keep, scale=0.3, bias=added), **TOL)


def test_fused_attn_dropout_only_when_training_and_keyed_by_seed():
    q, k, v = inputs()
    keep = te_visible("causal", SQ, SK)
    plain = expected(q, k, v, keep, scale=0.3)
    np.testing.assert_allclose(te_fused((q, k, v), None, "causal", dropout_probability=0.5), plain, **TOL)
    legacy = te_fused(
        (q, k, v), None, "causal", dropout_probability=0.5, is_training=True, seed=jax.random.PRNGKey(4)
    )
    typed = te_fused(
        (q, k, v), None, "causal", dropout_probability=0.5, is_training=True, seed=jax.random.key(4)
    )
    np.testing.assert_array_equal(legacy, typed)  # the same key, as data or typed
    assert np.abs(legacy - plain).max() > 1e-2
    with pytest.raises(ValueError, match="seed is not allowed to be None"):
        te_fused((q, k, v), None, "causal", dropout_probability=0.5, is_training=True)


def test_fused_attn_thd_raises():
    q, k, v = inputs()
    with pytest.raises(NotImplementedError, match="THD_THD_THD"):
        te_fused((q, k, v), None, "padding_causal", layout="THD_THD_THD")


def test_functional_module_needs_no_flax():
    """fused_attn, its enums and SequenceDescriptor serve code without Flax (levanter is Equinox)."""
    code = "import sys, flashport.integrations.transformer_engine_compat; print('flax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
