"""Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on :func:`flashport.torch.attention`.

The codemod (FPA101) rewrites an SDPA call whose arguments it can see into an explicit
``flashport.torch.attention(...)`` call; a call whose arguments are only known at run time
(``F.scaled_dot_product_attention(*args, **kwargs)``) becomes a call of
:func:`scaled_dot_product_attention` here, which takes SDPA's signature (torch 2.5+) and applies the
same mapping when it runs:

* layout ``[B, H, S, E]`` -> ``layout="BHSD"`` (rank 4 only: the contract has no extra batch dims);
* ``is_causal`` is top-left (``tril(ones(L, S))``) -> ``causal=True, align="top_left"``;
* ``attn_mask``: boolean (True = attend) -> ``mask``, float (additive) -> ``bias``;
* ``scale`` (None = ``1/sqrt(E)``) -> ``scale``; ``dropout_p`` -> ``dropout_p`` (same meaning,
  torch's default generator);
* ``enable_gqa=True``: key/value heads divide query heads, contiguous groups (``repeat_interleave``),
  as the contract; without it SDPA requires equal head counts, and so does this drop-in.

``attn_mask`` together with ``is_causal=True`` keeps the keys both allow (SDPA's math path on CPU
does this; its CUDA kernels reject the pair). Unequal head counts without ``enable_gqa`` raise
``RuntimeError`` as SDPA does. Rows whose mask hides every key give 0 (SDPA >= 2.5 on its fused
kernels).
"""

from __future__ import annotations

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """torch SDPA: query [B, H, L, E], key/value [B, Hk, S, E] -> [B, H, L, Ev] (module docstring).

    Raises:
      RuntimeError: unequal query/key heads without ``enable_gqa`` (SDPA's own error).
    """
    import flashport.torch
    from flashport.kernels.sdpa_compat import sdpa_mask

    if not enable_gqa and query.ndim >= 3 and key.ndim >= 3 and query.shape[-3] != key.shape[-3]:
        raise RuntimeError(
            f"scaled_dot_product_attention: query has {query.shape[-3]} heads and key {key.shape[-3]}; "
            "pass enable_gqa=True for grouped-query attention"
        )
    return flashport.torch.attention(
        query,
        key,
        value,
        scale=scale,
        causal=bool(is_causal),
        align="top_left",
        layout="BHSD",
        **sdpa_mask(attn_mask),
        **({"dropout_p": dropout_p} if dropout_p else {}),
    )
