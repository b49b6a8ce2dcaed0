"""xformers' ``memory_efficient_attention`` and its ``attn_bias`` classes (``xformers/ops/fmha``
at tag v0.0.35: ``__init__.py`` and ``attn_bias.py``)."""

from __future__ import annotations

from flashport.rules.apis.model import Api, DropIn, Param, Params, Version, keyword_only, params

XFORMERS_COMPAT = "flashport.integrations.xformers_compat"
RELEASE: Version = (0, 0, 35)
_BIAS_MODULES = ("xformers.ops.", "xformers.ops.fmha.attn_bias.", "xformers.ops.fmha.")

_MATERIALIZE_DEVIATION = (
    "dtype=None stands for xformers' default torch.float32 (the drop-ins import torch only when "
    "called, so no torch object can be a default)"
)
_BLOCK_DIAGONAL_DEVIATION = (
    "the dataclass fields are the per-sequence lengths (q_seqlen, kv_seqlen) instead of xformers' "
    "private _SeqLenInfo objects, and every class carries _window_size; build them as upstream code "
    "does, with from_seqlens / from_tensor_list / make_*"
)
_BLOCK_DIAGONAL_FIELDS = params(q_seqlen=[], kv_seqlen=[], _batch_sizes=None, _window_size=0)
BLOCK_DIAGONAL = (
    "BlockDiagonalMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionMask",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
)


def _api(
    name: str, parameters: Params | None, returns: str = "out", deviation: str = "", own: Params | None = None
) -> Api:
    """An xformers API ``name`` (``Class``, ``Class.method`` or a function) with its drop-in of the
    same name in ``xformers_compat``."""
    modules = (
        ("xformers.ops.", "xformers.ops.fmha.") if "." not in name and name[0].islower() else _BIAS_MODULES
    )
    return Api(
        names=tuple(m + name for m in modules),
        signatures=((RELEASE, parameters),) if parameters is not None else (),
        returns=returns,
        drop_ins=(DropIn(XFORMERS_COMPAT, name, (RELEASE,), deviation=deviation, signature=own),),
    )


_MEA = params("query", "key", "value", attn_bias=None, p=0.0, scale=None) + keyword_only(
    op=None, output_dtype=None
)
_MATERIALIZE = (Param("self"), Param("shape"), Param("dtype", "torch.float32"), Param("device", "cpu"))
_MATERIALIZE_OWN = params("self", "shape", dtype=None, device="cpu")

APIS: tuple[Api, ...] = (
    _api(
        "memory_efficient_attention",
        _MEA,
        deviation="adds flashport's keyword-only backend='auto' and generator=None (dropout's RNG) after xformers' parameters",
        own=_MEA + keyword_only(backend="auto", generator=None),
    ),
    _api("AttentionBias", ()),
    _api("AttentionBias.materialize", _MATERIALIZE, deviation=_MATERIALIZE_DEVIATION, own=_MATERIALIZE_OWN),
    _api("LowerTriangularMask", params(device=None)),
    _api("LowerTriangularMask.add_bias", params("self", "bias")),
    _api("LowerTriangularMaskWithTensorBias", params("bias")),
    _api(
        "LowerTriangularMaskWithTensorBias.materialize",
        _MATERIALIZE,
        deviation=_MATERIALIZE_DEVIATION,
        own=_MATERIALIZE_OWN,
    ),
    _api("LowerTriangularFromBottomRightMask", ()),
    _api("LowerTriangularFromBottomRightMask.make_local_attention", params("self", "window_size")),
    _api("LowerTriangularFromBottomRightLocalAttentionMask", params("_window_size")),
    _api("LocalAttentionFromBottomRightMask", params("window_left", "window_right")),
    *(
        _api(
            name,
            params("q_seqinfo", "k_seqinfo", _batch_sizes=None)
            + (params(_window_size=0) if "Local" in name else ()),
            deviation=_BLOCK_DIAGONAL_DEVIATION,
            own=_BLOCK_DIAGONAL_FIELDS,
        )
        for name in BLOCK_DIAGONAL
    ),
    *(
        _api(f"{name}.from_seqlens", params("q_seqlen", kv_seqlen=None) + keyword_only(device=None))
        for name in BLOCK_DIAGONAL
    ),
    *(
        _api(f"{name}.from_tensor_list", params("tensors"), returns="(bias, concatenated tensor)")
        for name in BLOCK_DIAGONAL
    ),
    _api("BlockDiagonalMask.split", params("self", "tensor"), returns="list of tensors"),
    _api("BlockDiagonalMask.make_causal", params("self")),
    _api("BlockDiagonalMask.make_causal_from_bottomright", params("self")),
    _api("BlockDiagonalCausalMask.make_local_attention", params("self", "window_size")),
    _api("BlockDiagonalCausalFromBottomRightMask.make_local_attention", params("self", "window_size")),
)

OWN_API = {XFORMERS_COMPAT: frozenset(("contract_kwargs",))}
# Public methods of the drop-in classes that are flashport's own (xformers has no such method).
OWN_METHODS = frozenset(("window",))
