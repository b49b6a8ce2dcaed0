"""torch's ``scaled_dot_product_attention`` (docs 2.15; ``scale`` keyword-only from 2.1, ``enable_gqa``
keyword-only from 2.5)."""

from __future__ import annotations

from flashport.rules.apis import Api, DropIn, keyword_only, params

SDPA_COMPAT = "flashport.integrations.sdpa_compat"
SDPA_RELEASE = (2, 5, 0)
_POSITIONAL = params("query", "key", "value", attn_mask=None, dropout_p=0.0, is_causal=False)

APIS = (
    Api(
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
    ),
)
