"""JAX's attention entry points with drop-ins: ``jax.nn.dot_product_attention`` and the cuDNN
``dot_product_attention`` of ``jax._src.cudnn.fused_attention_stablehlo`` (jax 0.10.2's signatures).

An enum default is recorded as ``"Enum.MEMBER"`` (no jax object in this module)."""

from __future__ import annotations

from flashport.rules.apis.model import Version, keyword_only, one_release, params

JAX_NN_COMPAT = "flashport.integrations.jax_nn_compat"
JAX_CUDNN_COMPAT = "flashport.integrations.jax_cudnn_compat"
RELEASE: Version = (0, 10, 2)

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
)
