"""JAX's attention entry points with drop-ins: ``jax.nn.dot_product_attention`` and the cuDNN
``dot_product_attention`` of ``jax._src.cudnn.fused_attention_stablehlo`` (jax 0.10.2's signatures).

An enum default is recorded as ``"Enum.MEMBER"`` (no jax object in this module)."""

from __future__ import annotations

from flashport.rules.apis.model import Api, DropIn, Version, keyword_only, params

JAX_NN_COMPAT = "flashport.integrations.jax_nn_compat"
JAX_CUDNN_COMPAT = "flashport.integrations.jax_cudnn_compat"
RELEASE: Version = (0, 10, 2)

APIS = (
    Api(
        names=("jax.nn.dot_product_attention",),
        signatures=(
            (
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
            ),
        ),
        returns="out; (out, lse) with return_residual=True",
        lse="[B, T, N] fp32",
        drop_ins=(DropIn(JAX_NN_COMPAT, "dot_product_attention", (RELEASE,)),),
    ),
    Api(
        names=("jax._src.cudnn.fused_attention_stablehlo.dot_product_attention",),
        signatures=(
            (
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
            ),
        ),
        returns="out; (out, lse) with return_residual=True",
        lse="[B, N, T] fp32",
        drop_ins=(DropIn(JAX_CUDNN_COMPAT, "dot_product_attention", (RELEASE,)),),
    ),
)
