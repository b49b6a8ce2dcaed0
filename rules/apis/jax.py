"""JAX's attention entry points with drop-ins: ``jax.nn.dot_product_attention`` and the cuDNN
``dot_product_attention`` of ``jax._src.cudnn.fused_attention_stablehlo`` (jax 0.10.2's signatures),
and TransformerEngine-JAX's Flax ``DotProductAttention`` module (its fields at TransformerEngine 2.18;
Flax's own ``parent``/``name`` fields are not listed) with the ``SequenceDescriptor`` it reads, and
TransformerEngine-JAX 2.0's functional ``fused_attn`` (the last release whose third parameter is ``mask``).

An enum default is recorded as ``"Enum.MEMBER"`` (no jax object in this module)."""

from __future__ import annotations

from flashport.rules.apis.model import Api, DropIn, Version, keyword_only, one_release, params

JAX_NN_COMPAT = "flashport.integrations.jax_nn_compat"
JAX_CUDNN_COMPAT = "flashport.integrations.jax_cudnn_compat"
TE_COMPAT = "flashport.integrations.transformer_engine_compat"
TE_FLAX = "flashport.integrations.transformer_engine_flax"
RELEASE: Version = (0, 10, 2)
TE_RELEASE: Version = (2, 18, 0)
TE_FUSED_ATTN_RELEASE: Version = (2, 0, 0)
# TransformerEngine-JAX's QKVLayout and AttnBiasType members (transformer_engine/jax/attention.py);
# the drop-ins serve the separate and packed layouts, not THD sequence packing.
TE_LAYOUTS = ("BSHD_BSHD_BSHD", "BS3HD", "BSHD_BS2HD")
TE_THD_LAYOUTS = ("THD_THD_THD", "T3HD", "THD_T2HD")
TE_BIAS_TYPES = ("NO_BIAS", "PRE_SCALE_BIAS", "POST_SCALE_BIAS")

# transformer_engine/jax/attention.py at v2.0 (v2.1 renamed ``mask`` to ``sequence_descriptor``).
TE_FUSED_ATTN = params(
    "qkv",
    "bias",
    "mask",
    "seed",
    "attn_bias_type",
    "attn_mask_type",
    "qkv_layout",
    "scaling_factor",
    "dropout_probability",
    "is_training",
    window_size=None,
    context_parallel_strategy="CPStrategy.DEFAULT",
    context_parallel_causal_load_balanced=False,
    context_parallel_axis="",
)

# transformer_engine/jax/flax/transformer.py at v2.18: the module's fields, in order (earlier releases
# have a prefix of them; ``transpose_batch_sequence`` defaulted to True before 2.10).
TE_DOT_PRODUCT_ATTENTION = params(
    "head_dim",
    "num_attention_heads",
    num_gqa_groups=None,
    attention_dropout=0.0,
    attn_mask_type="causal",
    attn_bias_type=None,
    dtype=None,
    dropout_rng_name="dropout",
    float32_logits=False,
    qkv_layout="bshd_bshd_bshd",
    scale_factor=None,
    transpose_batch_sequence=None,
    window_size=None,
    max_segments_per_seq=1,
    context_parallel_causal_load_balanced=False,
    context_parallel_axis="",
    context_parallel_strategy="DEFAULT",
    context_checkpoint_name="context",
    softmax_type="vanilla",
    score_mod=None,
    score_mod_bprop=None,
)

_RETURNS = "out; (out, lse) with return_residual=True"

APIS = (
    one_release(
        ("jax.nn.dot_product_attention",),
        RELEASE,
        params("query", "key", "value", bias=None, mask=None)
        + keyword_only(
            scale=None,
            is_causal=False,
            query_seq_lengths=None,
            key_value_seq_lengths=None,
            local_window_size=None,
            implementation=None,
            return_residual=False,
        ),
        JAX_NN_COMPAT,
        returns=_RETURNS,
        lse="[B, T, N] fp32",
    ),
    one_release(
        ("jax._src.cudnn.fused_attention_stablehlo.dot_product_attention",),
        RELEASE,
        params(
            "query",
            "key",
            "value",
            bias=None,
            mask=None,
            q_seqlen=None,
            kv_seqlen=None,
            q_offsets=None,
            kv_offsets=None,
            fp8_params=None,
        )
        + keyword_only(
            scale=1.0,
            mask_type="MaskType.NO_MASK",
            seed=42,
            dropout_rate=0.0,
            qkv_layout="BTNH",
            sliding_window_length=None,
            use_fp8=False,
            return_residual=False,
        ),
        JAX_CUDNN_COMPAT,
        returns=_RETURNS,
        lse="[B, N, T] fp32",
    ),
    Api(
        names=(
            "transformer_engine.jax.flax.DotProductAttention",
            "transformer_engine.jax.flax.transformer.DotProductAttention",
        ),
        signatures=((TE_RELEASE, TE_DOT_PRODUCT_ATTENTION),),
        returns="out (a Flax module: the output of its __call__)",
        drop_ins=(DropIn(TE_FLAX, "DotProductAttention", (TE_RELEASE,)),),
    ),
    *(
        Api(
            names=(f"transformer_engine.jax.attention.SequenceDescriptor{method}",),
            signatures=((TE_RELEASE, parameters),),
            returns="a SequenceDescriptor",
            drop_ins=(DropIn(TE_COMPAT, f"SequenceDescriptor{method}", (TE_RELEASE,)),),
        )
        for method, parameters in (
            ("", params(seqlens=None, seq_offsets=None, segment_ids=None, segment_pos=None)),
            (".from_seqlens", params("seqlens")),
            (".from_seqlens_and_offsets", params("seqlens", "seq_offsets")),
            (".from_segment_ids_and_pos", params("segment_ids", segment_pos=None)),
        )
    ),
    Api(
        names=("transformer_engine.jax.attention.fused_attn",),
        signatures=((TE_FUSED_ATTN_RELEASE, TE_FUSED_ATTN),),
        returns="out",
        drop_ins=(DropIn(TE_COMPAT, "fused_attn", (TE_FUSED_ATTN_RELEASE,)),),
    ),
)
