"""JAX catalogue rules FPA202-FPA209: rewrites are EXECUTED and compared with the original API.

For every rewritable rule a small module ``def run(...): return <original call>`` is rewritten by
the engine; then the original runs (the real API where it runs on CPU: Pallas GPU kernels in
interpret mode, keras on the JAX backend; otherwise the independent float64 emulation in
``jax_api_reference.py``) and the rewritten module runs through ``flashport.attention`` on CPU. The
two outputs must agree on random inputs, including Sq != Sk and GQA. Refusals must leave the file
byte-identical and say why.
"""

from __future__ import annotations

import functools
import os
import types

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax_api_reference as ref
import numpy as np
import pytest
from reference import reference_attention

import flashport
import flashport.integrations.jax_cudnn_compat
import flashport.integrations.transformer_engine_compat
import flashport.integrations.transformer_engine_flax
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules import all_rules

SIGNATURE = "def run(q, k, v, m=None, b=None, seg=None, cu=None):\n    return {call}\n"
TOL = dict(atol=3e-5, rtol=3e-5)


def rewrite(header: str, call: str) -> tuple[str, str, list]:
    """(original source, rewritten source, sites) for ``call`` inside ``run`` after ``header``."""
    source = header + "\n\n" + SIGNATURE.format(call=call)
    result = transform_source(source.encode(), "snippet.py", all_rules())
    assert result.error is None, result.error
    new = result.new.decode() if result.new is not None else source
    return source, new, result.sites


def load(text: str, namespace: dict):
    """Execute a snippet without its import lines (names come from ``namespace``); return ``run``."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith(("import ", "from ")))
    namespace = dict(namespace)
    exec(compile(body, "<snippet>", "exec"), namespace)
    return namespace["run"]


def rewritten_run(header: str, call: str):
    """Rewrite ``call``; assert exactly one rewrite; return (original source, rewritten ``run``)."""
    source, new, sites = rewrite(header, call)
    # one rewritten call, plus any API value it reads (a MaskType member moves to the drop-in's enum)
    assert [s.status for s in sites if s.kind == "call"] == ["rewrite"], sites
    assert all(s.status == "rewrite" for s in sites), sites
    assert "flashport." in new
    return source, load(new, {"flashport": flashport})


def inputs(b=2, sq=5, sk=9, hq=4, hkv=2, d=16, seed=0):
    """Random float32 q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D], bool mask, float bias [B,Hq,Sq,Sk]."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d), dtype=np.float32)
    k = rng.standard_normal((b, sk, hkv, d), dtype=np.float32)
    v = rng.standard_normal((b, sk, hkv, d), dtype=np.float32)
    mask = rng.random((b, 1, sq, sk)) > 0.3
    mask[..., -1] = True  # every row sees a key (fully masked rows differ by design)
    bias = rng.standard_normal((b, hq, sq, sk), dtype=np.float32)
    return q, k, v, mask, bias


def close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), **TOL)


# ------------------------------------------------------------------------------------ FPA202 cuDNN

CUDNN_HEADER = "from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention, MaskType"


@pytest.mark.parametrize(
    "call, layout",
    [
        ("dot_product_attention(q, k, v)", "BTNH"),  # scale defaults to 1.0
        ("dot_product_attention(q, k, v, scale=0.25, mask_type=MaskType.CAUSAL)", "BTNH"),
        ("dot_product_attention(q, k, v, b, m, scale=0.3, seed=7)", "BTNH"),
        (
            "dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL, sliding_window_length=3, dropout_rate=0.0)",
            "BTNH",
        ),
        (
            "dot_product_attention(q, k, v, mask=m, mask_type=MaskType.NO_MASK, qkv_layout='BNTH', scale=0.2)",
            "BNTH",
        ),
    ],
)
def test_cudnn_rewrite_matches_cudnn_semantics(call, layout):
    """The rewrite equals the float64 emulation of the cuDNN API, Sq != Sk and GQA included."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    source, run = rewritten_run(CUDNN_HEADER, call)
    original = load(source, {"dot_product_attention": ref.cudnn_dot_product_attention, "MaskType": MaskType})
    q, k, v, mask, bias = inputs(sq=6, sk=10)
    if layout == "BNTH":
        q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    close(run(q, k, v, mask, bias), original(q, k, v, mask, bias))


def test_cudnn_default_scale_is_one_not_rsqrt_d():
    """The trap: the rewrite must say scale=1.0, which differs from the contract's default."""
    _, new, _ = rewrite(CUDNN_HEADER, "dot_product_attention(q, k, v)")
    assert "scale=1.0" in new and 'align="top_left"' in new and 'layout="BSHD"' in new


# ------------------------------------------------------------------------------ FPA203 Pallas mha


def _pallas_mha_cpu(module):
    """The real Pallas GPU kernel in interpret mode with small blocks (runs on CPU)."""

    @functools.wraps(module.mha)
    def mha(*args, **kwargs):
        kwargs.update(interpret=True, block_sizes=module.BlockSizes(block_q=16, block_k=16))
        return module.mha(*args, **kwargs)

    return mha


@pytest.mark.parametrize(
    "header, call",
    [
        (
            "from jax.experimental.pallas.ops.gpu import attention",
            "attention.mha(q, k, v, None, causal=True)",
        ),
        (
            "from jax.experimental.pallas.ops.gpu.attention import mha",
            "mha(q, k, v, seg, 0.2, True, num_warps=4)",
        ),
    ],
)
def test_pallas_mha_rewrite_matches_kernel(header, call):
    """Run the Pallas GPU kernel (interpret mode) and the rewrite; sm_scale default 1.0, top-left causal."""
    from jax.experimental.pallas.ops.gpu import attention as module

    source, run = rewritten_run(header, call)
    mha = _pallas_mha_cpu(module)
    original = load(source, {"attention": types.SimpleNamespace(mha=mha), "mha": mha})
    same = "seg" in call  # segment ids are shared by q and kv, so Sq == Sk
    q, k, v, _, _ = inputs(sq=32, sk=32 if same else 48, hq=2, hkv=2)
    seg = np.repeat(np.array([[0] * 12 + [1] * 20]), 2, axis=0).astype(np.int32)
    close(run(q, k, v, seg=seg), original(q, k, v, seg=seg))


def test_pallas_mha_old_module_path_and_residuals_refusal():
    """The jax <= 0.4.28 path is matched; return_residuals (base-2 lse) is refused byte-identical."""
    _, new, sites = rewrite("from jax.experimental.pallas.ops.attention import mha", "mha(q, k, v, None)")
    assert sites[0].status == "rewrite" and "scale=1.0" in new
    source, new, sites = rewrite(
        "from jax.experimental.pallas.ops.gpu import attention",
        "attention.mha(q, k, v, None, return_residuals=True)",
    )
    assert new == source and sites[0].status == "refused" and "base-2" in sites[0].reason


# ---------------------------------------------------------------------------- FPA204 Pallas decode


@pytest.mark.parametrize(
    "call, hkv",
    [
        ("decode_attention.gqa(q[:, 0], k, v)", 2),  # sm_scale None -> 1/sqrt(D)
        ("decode_attention.gqa(q[:, 0], k, v, sm_scale=0.3, k_splits=2)", 1),
        ("decode_attention.mqa(q[:, 0], k[:, :, 0], v[:, :, 0], sm_scale=0.5)", 1),
    ],
)
def test_pallas_decode_rewrite_matches_kernel(call, hkv):
    """Run the Pallas decode kernels (interpret mode) and the rewrite on one query token."""
    from jax.experimental.pallas.ops.gpu import decode_attention as module

    source, run = rewritten_run("from jax.experimental.pallas.ops.gpu import decode_attention", call)
    cpu = types.SimpleNamespace(
        gqa=functools.partial(module.gqa, interpret=True, block_k=16, k_splits=2),
        mqa=functools.partial(module.mqa, interpret=True, block_k=16, k_splits=2),
    )

    original = load(source, {"decode_attention": cpu})
    q, k, v, _, _ = inputs(sq=1, sk=32, hq=4, hkv=hkv)
    close(run(q, k, v), original(q, k, v))


def test_pallas_decode_refuses_kv_ranges():
    source, new, sites = rewrite(
        "from jax.experimental.pallas.ops.gpu import decode_attention",
        "decode_attention.gqa(q, k, v, kv_seq_len=cu)",
    )
    assert new == source and "kv_seq_len" in sites[0].reason


# ------------------------------------------------------------------------- FPA205/206 flash-attn-jax


@pytest.mark.parametrize(
    "call",
    [
        "flash_mha(q, k, v)",
        "flash_mha(q, k, v, is_causal=True)",  # bottom-right: Sq < Sk keeps the last rows full
        "flash_mha(q, k, v, 0.3, True, (2, -1))",
        "flash_mha(q, k, v, window_size=(1, 2))",
    ],
)
def test_flash_attn_jax_rewrite_matches_fa2_semantics(call):
    source, run = rewritten_run("from flash_attn_jax import flash_mha", call)
    original = load(source, {"flash_mha": ref.flash_mha})
    q, k, v, _, _ = inputs(sq=4, sk=9)
    close(run(q, k, v), original(q, k, v))


@pytest.mark.parametrize(
    "call",
    [
        "flash_mha_varlen(q, k, v, cu, is_causal=True, max_seqlen_q=8)",
        "flash_mha_varlen(q, k, v, cu, cu, softmax_scale=0.2, window_size=(2, 0))",
    ],
)
def test_flash_attn_jax_varlen_rewrite_uses_cumulative_seqlens(call):
    """seqlens_q are fence-posts; per-sequence bottom-right masks (equal q/k lengths here)."""
    source, run = rewritten_run("from flash_attn_jax import flash_mha_varlen", call)
    original = load(source, {"flash_mha_varlen": ref.flash_mha_varlen})
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((14, 4, 8), dtype=np.float32) for _ in range(3))
    cu = np.array([0, 3, 8, 12], np.int32)  # two padding tokens past cu[-1]
    got, want = np.asarray(run(q, k, v, cu=cu)), original(q, k, v, cu=cu)
    close(got, want)
    assert np.all(got[12:] == 0)


def test_flash_attn_jax_varlen_distinct_k_lengths():
    """seqlens_k given separately: per-sequence offsets len_k - len_q (Sq != Sk per sequence)."""
    source, run = rewritten_run(
        "from flash_attn_jax import flash_mha_varlen", "flash_mha_varlen(q, k, v, cu, m, is_causal=True)"
    )
    original = load(source, {"flash_mha_varlen": ref.flash_mha_varlen})
    rng = np.random.default_rng(4)
    q = rng.standard_normal((7, 2, 8), dtype=np.float32)
    k, v = (rng.standard_normal((12, 2, 8), dtype=np.float32) for _ in range(2))
    cu_q, cu_k = np.array([0, 2, 7], np.int32), np.array([0, 5, 12], np.int32)
    close(run(q, k, v, m=cu_k, cu=cu_q), original(q, k, v, m=cu_k, cu=cu_q))


# ------------------------------------------------------------------------------------ FPA207 keras


def _keras_no_flash():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras is not on the JAX backend")

    def dot_product_attention(*args, **kwargs):
        kwargs["flash_attention"] = False  # flash raises on CPU; the result does not depend on it
        return keras.ops.dot_product_attention(*args, **kwargs)

    return types.SimpleNamespace(dot_product_attention=dot_product_attention)


@pytest.mark.parametrize(
    "call",
    [
        "ops.dot_product_attention(q, k, v, flash_attention=True)",
        "ops.dot_product_attention(q, k, v, is_causal=True, flash_attention=True)",  # top-left
        "ops.dot_product_attention(q, k, v, b, m, 0.2, flash_attention=self_flash)",
    ],
)
def test_keras_rewrite_matches_keras(call):
    """Real keras.ops.dot_product_attention (JAX backend, XLA path) vs the rewrite."""
    ops = _keras_no_flash()
    call = call.replace("self_flash", "seg")  # a non-literal flash_attention argument
    source, run = rewritten_run("from keras import ops", call)
    original = load(source, {"ops": ops})
    q, k, v, mask, bias = inputs(sq=6, sk=11)
    close(run(q, k, v, mask, bias, seg=True), original(q, k, v, mask, bias, seg=True))


def test_keras_without_flash_is_not_reported_and_softcap_refused():
    source, new, sites = rewrite("from keras import ops", "ops.dot_product_attention(q, k, v, mask=m)")
    assert new == source and sites == []
    source, new, sites = rewrite(
        "import keras",
        "keras.ops.dot_product_attention(q, k, v, flash_attention=True, attn_logits_soft_cap=30.0)",
    )
    assert new == source and "attn_logits_soft_cap" in sites[0].reason


# ------------------------------------------------------------------------ FPA208 TE Flax module

TE_HEADER = "from transformer_engine.jax.flax.transformer import DotProductAttention"


@pytest.mark.parametrize(
    ("mask_type", "causal", "align", "masked"),
    [
        ("no_mask", False, "top_left", False),
        ("causal", True, "top_left", False),
        ("causal_bottom_right", True, "bottom_right", False),
        ("padding_causal", True, "top_left", True),
        ("padding", False, "top_left", True),
    ],
)
def test_te_module_construction_runs_on_the_drop_in(mask_type, causal, align, masked):
    """The construction moves to flashport's Flax drop-in; the module's call (TE's mask: True =
    masked out) keeps TE's meaning: the float64 reference with the mask negated."""
    call = (
        f"DotProductAttention(head_dim=16, num_attention_heads=4, num_gqa_groups=2, "
        f"attn_mask_type={mask_type!r}, scale_factor=0.25, transpose_batch_sequence=False)"
        ".apply({}, q, k, v, m)"
    )
    _, run = rewritten_run(TE_HEADER, call)
    q, k, v, mask, _ = inputs()
    want, _ = reference_attention(
        q, k, v, scale=0.25, causal=causal, align=align, mask=mask if masked else None, layout="BSHD"
    )
    close(run(q, k, v, m=~mask), want)


@pytest.mark.parametrize(
    ("member", "causal", "masked"),
    [("NO_MASK", False, False), ("CAUSAL_MASK", True, False), ("PADDING_CAUSAL_MASK", True, True)],
)
def test_te_fused_attn_keyword_call_runs_on_the_drop_in(member, causal, masked):
    """levanter's form (every argument by keyword, mask= of TE <= 2.0): the call and the enum members
    move to the drop-in module; TE's mask is True = masked out."""
    call = (
        "fused_attn(qkv=(q, k, v), bias=None, mask=m, seed=None, attn_bias_type=AttnBiasType.NO_BIAS, "
        f"attn_mask_type=AttnMaskType.{member}, qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=0.25, "
        "dropout_probability=0.1, is_training=False)"
    )
    _, run = rewritten_run(
        "from transformer_engine.jax.attention import AttnBiasType, AttnMaskType, QKVLayout, fused_attn", call
    )
    q, k, v, mask, _ = inputs()
    want, _ = reference_attention(
        q, k, v, scale=0.25, causal=causal, align="top_left", mask=mask if masked else None, layout="BSHD"
    )
    close(run(q, k, v, m=~mask), want)


# ------------------------------------------------------------------------------ refusals, all rules

REFUSALS = [
    (
        "from jax.experimental.pallas.ops.gpu import attention",
        "attention.mha(q, k, v, seg[0])",
        "evaluated twice",
    ),
    ("from flash_attn_jax import flash_mha", "flash_mha(q, k, v, window_size=w)", "window_size"),
    ("from flash_attn_jax import flash_mha", "flash_mha(q, k, v, filter_nan=True)", "unknown argument"),
    (
        "from flash_attn_jax import flash_mha_varlen",
        "flash_mha_varlen(q, k, v, cu, cu, None, 8)",
        "positional",
    ),
    (
        "from transformer_engine.jax.flax import DotProductAttention",
        "DotProductAttention(head_dim=64, num_attention_heads=8)",
        "transpose_batch_sequence is not stated",
    ),
    (
        "from transformer_engine.jax.flax import DotProductAttention",
        "DotProductAttention(64, 8, qkv_layout='thd_thd_thd', transpose_batch_sequence=False)",
        "THD sequence packing",
    ),
    (
        "from transformer_engine.jax.flax import DotProductAttention",
        "DotProductAttention(64, 8, softmax_type='off-by-one', transpose_batch_sequence=False)",
        "softmax_type='off-by-one'",
    ),
    (
        "from transformer_engine.jax.flax import DotProductAttention",
        "DotProductAttention(64, 8, transpose_batch_sequence=None)",
        "transpose_batch_sequence=None",
    ),
    (
        "from transformer_engine.jax.flax import DotProductAttention",
        "DotProductAttention(**cfg, transpose_batch_sequence=False)",
        "**kwargs splat",
    ),
    (
        "from transformer_engine.jax.praxis import DotProductAttention",
        "DotProductAttention(head_dim=64, num_attention_heads=8)",
        "Praxis",
    ),
    (
        "from transformer_engine.jax.attention import fused_attn",
        "fused_attn((q, k, v), None, seg, None, None, mt, None, 0.1, 0.0, False)",
        "mask= is not passed by keyword",
    ),
    (
        "from transformer_engine.jax.attention import fused_attn",
        "fused_attn(qkv=(q, k, v), bias=None, mask=m, seed=None, attn_bias_type=None, attn_mask_type=mt, "
        "qkv_layout=None, scaling_factor=0.1, dropout_probability=0.0, is_training=False, softmax_type=st)",
        "unknown argument 'softmax_type'",
    ),
    (
        "from transformer_engine.jax.attention import fused_attn",
        "fused_attn((q, k, v), None, seg, None, None, None, None, 0.1, p, True)",
        "dropout_probability",
    ),
]


# What the functional rewrite cannot express, JAX's private cuDNN entry keeps through its drop-in:
# the call stays as written, pointed at flashport.integrations.jax_cudnn_compat (same signature).
CUDNN_DROP_IN_CALLS = [
    "dot_product_attention(q, k, v, dropout_rate=0.1)",
    "dot_product_attention(q, k, v, mask_type=MaskType.PADDING_CAUSAL, q_seqlen=cu, kv_seqlen=cu)",
    "dot_product_attention(q, k, v, mask_type=mt)",
    "dot_product_attention(q, k, v, scale=jnp.sqrt(q.shape[-1]))",
    "dot_product_attention(q, k, v, **kw)",
    "dot_product_attention(q, k, v, return_residual=True)",
    "dot_product_attention(q, k, v, qkv_layout=layout)",
]


@pytest.mark.parametrize("call", CUDNN_DROP_IN_CALLS)
def test_cudnn_calls_the_functional_rewrite_cannot_take_go_to_the_drop_in(call):
    _, new, sites = rewrite(CUDNN_HEADER, call)
    assert sites and all(s.status == "rewrite" for s in sites), sites
    drop_in = "flashport.integrations.jax_cudnn_compat."
    assert drop_in + call.replace("MaskType.", drop_in + "MaskType.") in new, new
    compile(new, "snippet.py", "exec")


def test_cudnn_alibi_call_is_refused_and_its_mask_type_keeps_meaning_to_jax():
    """cuDNN's ALiBi mask type has no drop-in: the call stays jax's, with the reason. Its MaskType
    member may still move to the drop-in module, whose enum is jax's own, so jax's function reads
    the same member."""
    from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn

    _, new, sites = rewrite(CUDNN_HEADER, "dot_product_attention(q, k, v, mask_type=MaskType.ALIBI)")
    assert "    return dot_product_attention(q, k, v, mask_type=" in new
    assert any(s.kind == "call" and s.status == "refused" and "ALIBI" in s.reason for s in sites), sites
    assert flashport.integrations.jax_cudnn_compat.MaskType is jax_cudnn.MaskType


@pytest.mark.parametrize("header, call, reason", REFUSALS)
def test_refusals_are_byte_identical_with_reason(header, call, reason):
    source, new, sites = rewrite(header, call)
    assert new == source
    assert len(sites) == 1 and sites[0].status == "refused", sites
    assert reason in sites[0].reason and "\n" not in sites[0].reason


def test_inference_flag_drops_training_gated_dropout():
    from flashport.rules.base import RuleOptions

    source = (
        CUDNN_HEADER
        + "\n\n"
        + SIGNATURE.format(call="dot_product_attention(q, k, v, dropout_rate=0.1 if seg else 0.0)")
    )
    result = transform_source(source.encode(), "s.py", all_rules(), RuleOptions(inference=True))
    assert result.sites[0].status == "rewrite" and "dropout_rate" in result.sites[0].notes[0]
