"""Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on :func:`flashport.torch.attention`.

The codemod (FPA101) rewrites an SDPA call whose arguments it can see into an explicit
``flashport.torch.attention(...)`` call; a call whose arguments are only known at run time
(``F.scaled_dot_product_attention(*args, **kwargs)``) becomes a call of
:func:`scaled_dot_product_attention` here, which takes SDPA's signature (torch 2.5+) and applies the
same mapping when it runs:

* layout ``[B, H, S, E]`` -> ``layout="BHSD"``; SDPA's other ranks ``(..., L, E)`` (every dim before
  ``L`` a batch dim, ``-3`` the one ``enable_gqa`` groups) are brought to rank 4 around the call --
  leading dims of size 1 added (rank 2, 3), or the dims before ``-3`` flattened into one (rank 5+,
  key/value/mask broadcast to the query's batch dims first) -- and the output gets the query's;
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

**Run-time patches are honoured.** Code that replaces ``torch.nn.functional.scaled_dot_product_attention``
(a context-parallel SDPA, torch's own ``context_parallel``, a wrapper that picks kernels) expects
every ``F.scaled_dot_product_attention(...)`` call to reach its replacement. So, per call, when that
attribute is not torch's own function, the drop-in calls it with the arguments exactly as given
(positional stays positional, nothing added). torch's own function is recognised by identity with
``torch._C._nn.scaled_dot_product_attention``, the builtin ``torch.nn.functional`` binds when torch
is imported; that holds whatever is imported first, so a patch installed before flashport is
imported is still seen as a patch (a reference saved at flashport's import would take it for
torch's). A thread-local re-entrancy guard makes a ported call made *inside* the patch (the patch
delegating to "the real SDPA" through a ported call) run flashport's SDPA instead of calling the
patch again. flashport's own use of torch SDPA (:mod:`flashport.torch` on CPU) calls torch's
function directly, never a patch. The codemod uses this drop-in, arguments verbatim, for every SDPA
call of a run whose files patch SDPA (:mod:`flashport.rewriter.engine.run_context`).
"""

from __future__ import annotations

import functools
import threading

__all__ = ["scaled_dot_product_attention"]

_GUARD = threading.local()  # .active: this thread runs inside a patch the drop-in delegated to


def scaled_dot_product_attention(*args, **kwargs):
    """torch SDPA: query [B, H, L, E], key/value [B, Hk, S, E] -> [B, H, L, Ev] (module docstring).

    Runs the patch installed as ``torch.nn.functional.scaled_dot_product_attention`` when there is
    one (outside a call it made), flashport's SDPA otherwise. Signature: :func:`flashport_sdpa`'s.

    Raises:
      RuntimeError: unequal query/key heads without ``enable_gqa`` (SDPA's own error).
    """
    import torch
    import torch.nn.functional as F

    current = F.scaled_dot_product_attention
    if (
        current is torch._C._nn.scaled_dot_product_attention
        or current is scaled_dot_product_attention
        or getattr(_GUARD, "active", False)
    ):
        return flashport_sdpa(*args, **kwargs)
    _GUARD.active = True
    try:
        return current(*args, **kwargs)
    finally:
        _GUARD.active = False


def flashport_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
):
    """flashport's torch SDPA, whatever is patched in: query [B, H, L, E], key/value [B, Hk, S, E]
    -> [B, H, L, Ev] (module docstring).

    Raises:
      RuntimeError: unequal query/key heads without ``enable_gqa`` (SDPA's own error).
    """
    import flashport.torch
    from flashport.kernels.semantics.sdpa_compat import sdpa_mask

    if not enable_gqa and query.ndim >= 3 and key.ndim >= 3 and query.shape[-3] != key.shape[-3]:
        raise RuntimeError(
            f"scaled_dot_product_attention: query has {query.shape[-3]} heads and key {key.shape[-3]}; "
            "pass enable_gqa=True for grouped-query attention"
        )
    if query.ndim < 2 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise RuntimeError(
            "scaled_dot_product_attention: query, key and value must have the same rank (>= 2), got "
            f"{query.ndim}, {key.ndim} and {value.ndim}"
        )
    rank, rows = query.ndim, tuple(query.shape[:-1])
    query, key, value, attn_mask = _rank4(query, key, value, attn_mask)
    out = flashport.torch.attention(
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
    return out if rank == 4 else out.reshape(*rows, out.shape[-1])


# inspect.signature(scaled_dot_product_attention) shows SDPA's (flashport_sdpa's) through __wrapped__
functools.update_wrapper(scaled_dot_product_attention, flashport_sdpa, assigned=(), updated=())


def _rank4(query, key, value, attn_mask):
    """SDPA inputs of any rank as ``[B, H, S, E]`` (and a mask that broadcasts to the scores)."""
    rank = query.ndim
    if rank == 4:
        return query, key, value, attn_mask
    if rank < 4:
        pad = (1,) * (4 - rank)
        return (*(x.reshape(*pad, *x.shape) for x in (query, key, value)), attn_mask)
    lead = tuple(query.shape[:-3])
    key, value = (x.expand(*lead, *x.shape[-3:]) for x in (key, value))
    if attn_mask is not None and attn_mask.ndim > 3:
        attn_mask = attn_mask.reshape(*(1,) * (rank - attn_mask.ndim), *attn_mask.shape)
        attn_mask = attn_mask.expand(*lead, *attn_mask.shape[-3:]).reshape(-1, *attn_mask.shape[-3:])
    return (*(x.reshape(-1, *x.shape[-3:]) for x in (query, key, value)), attn_mask)
