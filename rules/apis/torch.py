"""torch's ``scaled_dot_product_attention`` (docs 2.15; ``scale`` keyword-only from 2.1, ``enable_gqa``
keyword-only from 2.5) and FlexAttention's ``flex_attention`` / ``create_block_mask`` (torch 2.5)."""

from __future__ import annotations

from flashport.rules.apis.model import Api, DropIn, keyword_only, params

SDPA_COMPAT = "flashport.integrations.sdpa_compat"
SDPA_RELEASE = (2, 5, 0)
_POSITIONAL = params("query", "key", "value", attn_mask=None, dropout_p=0.0, is_causal=False)

SDPA_API = Api(
    names=(
        "torch.nn.functional.scaled_dot_product_attention",
        "torch._C._nn.scaled_dot_product_attention",
    ),
    signatures=(
        ((2, 0, 0), _POSITIONAL),
        (
            (2, 1, 0),
            _POSITIONAL + keyword_only(scale=None),
        ),
        (
            SDPA_RELEASE,
            _POSITIONAL + keyword_only(scale=None, enable_gqa=False),
        ),
    ),
    returns="out",
    drop_ins=(DropIn(SDPA_COMPAT, "scaled_dot_product_attention", (SDPA_RELEASE,), exact=False),),
)

# FlexAttention (torch.nn.attention.flex_attention), as of torch 2.5; flashport.torch has these.
FLEX = "flashport.torch"
FLEX_RELEASE = (2, 5, 0)
_FLEX_ATTENTION = params(
    "query",
    "key",
    "value",
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    kernel_options=None,
)
_CREATE_BLOCK_MASK = params(
    "mask_mod", "B", "H", "Q_LEN", "KV_LEN", device="cuda", BLOCK_SIZE=128, _compile=False
)

APIS: tuple[Api, ...] = (
    SDPA_API,
    Api(
        names=("torch.nn.attention.flex_attention.flex_attention",),
        signatures=((FLEX_RELEASE, _FLEX_ATTENTION),),
        returns="out, or (out, lse) with return_lse=True",
        drop_ins=(
            DropIn(
                FLEX,
                "flex_attention",
                (FLEX_RELEASE,),
                exact=False,
                deviation=(
                    "adds torch's later keyword-only return_aux=None and flashport's keyword-only "
                    "backend='auto' after torch 2.5's parameters"
                ),
                signature=_FLEX_ATTENTION + keyword_only(return_aux=None, backend="auto"),
            ),
        ),
    ),
    Api(
        names=("torch.nn.attention.flex_attention.create_block_mask",),
        signatures=((FLEX_RELEASE, _CREATE_BLOCK_MASK),),
        returns="BlockMask",
        drop_ins=(DropIn(FLEX, "create_block_mask", (FLEX_RELEASE,), exact=False),),
    ),
)
