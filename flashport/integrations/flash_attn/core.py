"""The shared core of the flash-attn drop-ins: flash-attn's conventions in the contract's terms.

Every flash-attn drop-in of this package (FA1/FA2 in :mod:`.fa2`, the private kernels, FA3, FA4 and
the kvcache modules) reads flash-attn's window, lse, ALiBi, dropout and cache conventions from here,
and runs packed variable-length calls through :func:`varlen_core`, so each conversion is defined
once and no module imports another's private names.
"""

from __future__ import annotations

import inspect

from flashport.kernels.contract.varlen import attend_varlen
from flashport.kernels.semantics.visibility import band_visible

__all__ = [
    "alibi_bias",
    "cache_lengths",
    "dropout_keywords",
    "flash_attn_window",
    "kvcache_mask",
    "lse_from_flash_attn",
    "lse_like_flash_attn",
    "paged_rows",
    "varlen_core",
    "with_signature",
]


def with_signature(parameters, defaults):
    """Decorator: the drop-in ``body`` behind exactly the signature of the API it replaces.

    flash-attn's functions share long parameter lists; each drop-in states its list once, here, and
    its body receives the bound arguments by name (defaults applied), usually gathering the shared
    ones in ``**options``. ``inspect.signature`` of the result is the API's.

    Args:
      parameters: the names in order, space-separated. Names after ``|`` take ``defaults[name]``;
        names after ``*`` are keyword-only (with ``defaults[name]``); ``**name`` collects any other
        keywords (the body receives them as one dict ``name``).
      defaults: each optional parameter's default.

    A call that does not fit the signature raises TypeError naming the function, as Python would.
    """
    kind, optional, listed = inspect.Parameter.POSITIONAL_OR_KEYWORD, False, []
    for name in parameters.split():
        if name in ("|", "*"):
            optional = True
            kind = inspect.Parameter.KEYWORD_ONLY if name == "*" else kind
        elif name.startswith("**"):
            listed.append(inspect.Parameter(name[2:], inspect.Parameter.VAR_KEYWORD))
        else:
            default = defaults[name] if optional else inspect.Parameter.empty
            listed.append(inspect.Parameter(name, kind, default=default))
    signature = inspect.Signature(listed)

    def decorate(body):
        def drop_in(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"{body.__name__}() {err}") from None
            bound.apply_defaults()
            return body(**bound.arguments)

        drop_in.__signature__ = signature
        drop_in.__name__, drop_in.__qualname__, drop_in.__doc__ = (
            body.__name__,
            body.__qualname__,
            body.__doc__,
        )
        drop_in.__module__ = body.__module__
        return drop_in

    return decorate


def flash_attn_window(window_size):
    """flash-attn ``window_size=(l, r)`` (-1 = unbounded) as the contract's ``window`` (or None)."""
    left, right = (int(w) for w in window_size)
    if left < 0 and right < 0:
        return None
    return (None if left < 0 else left, None if right < 0 else right)


def lse_like_flash_attn(lse):
    """The contract's lse with flash-attn's value for a row that sees no key (+inf, not -inf)."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def lse_from_flash_attn(lse):
    """flash-attn's lse (+inf for a row that sees no key) as the contract's (float32, -inf)."""
    import torch

    lse = lse.to(torch.float32)
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def dropout_keywords(dropout_p):
    """The contract's dropout keywords: none for 0 (the default), else ``dropout_p``."""
    return {"dropout_p": dropout_p} if dropout_p else {}


def alibi_bias(slopes, s_q, s_k, causal, device):
    """flash-attn's ALiBi as an additive bias [B or 1, H, S_q, S_k] (float32), as its kernel adds it:
    ``slope * j`` when causal (a per-row constant away from the symmetric form), else
    ``-slope * |i + S_k - S_q - j|``."""
    import torch

    slopes = slopes.to(device=device, dtype=torch.float32)
    slopes = (slopes[None] if slopes.ndim == 1 else slopes)[:, :, None, None]
    j = torch.arange(s_k, device=device, dtype=torch.float32)
    if causal:
        return slopes * j
    i = torch.arange(s_q, device=device, dtype=torch.float32)[:, None]
    return -slopes * (i + s_k - s_q - j).abs()


def kvcache_mask(lengths, s_q, s_k, *, causal=False, window=None):
    """Boolean mask [B, 1, s_q, s_k]: key ``j < lengths[b]``, causal/window bottom-right per sequence.

    Args:
      lengths: int tensor [B], the number of valid keys of each sequence.
      s_q, s_k: query length and cache length.
      causal: keep ``j <= i + lengths[b] - s_q``.
      window: ``(left, right)`` inclusive around ``i + lengths[b] - s_q``; None on a side = unbounded.
    """
    import torch

    i = torch.arange(s_q, device=lengths.device)[None, :, None]
    j = torch.arange(s_k, device=lengths.device)[None, None, :]
    row = i + (lengths - s_q)[:, None, None]
    left, right = window if window is not None else (None, None)
    mask = band_visible(row, j, causal=causal, left=left, right=right, visible=j < lengths[:, None, None])
    return mask[:, None]


def cache_lengths(cache_seqlens, batch, default, device):
    """flash-attn's ``cache_seqlens`` (None, an int, or an int tensor [B] or [1]) as int64 [batch];
    None means ``default`` rows (the whole cache)."""
    import torch

    if cache_seqlens is None:
        return torch.full((batch,), default, dtype=torch.long, device=device)
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens.to(device=device, dtype=torch.long).reshape(-1).expand(batch)
    return torch.full((batch,), int(cache_seqlens), dtype=torch.long, device=device)


def paged_rows(cache, block_table, cu_seqlens_k):
    """Packed keys [total_k, Hk, D] of a paged cache [num_blocks, page, Hk, D] (sequence ``b`` is the
    first ``cu[b+1] - cu[b]`` rows of the pages ``block_table[b]``)."""
    import torch

    cu = cu_seqlens_k.to(device=cache.device, dtype=torch.long)
    pos = torch.arange(int(cu[-1]), device=cache.device)
    seq = torch.bucketize(pos, cu[1:].contiguous(), right=True)  # torchax lacks searchsorted(right=)
    row = pos - cu[seq]
    page = cache.shape[1]
    blocks = block_table.to(device=cache.device, dtype=torch.long)[seq, row // page]
    return cache[blocks, row % page]


def varlen_core(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    scale=None,
    causal=False,
    window=None,
    softcap=None,
    align="bottom_right",
    dropout_p=0.0,
    return_lse=False,
    block_table=None,
):
    """Packed variable-length attention on the contract, shared by the flash-attn 1/2/3/4 drop-ins.

    The O(total) layout of :func:`flashport.varlen_attention` (:mod:`flashport.kernels.contract.varlen`),
    batch 1 through :func:`flashport.torch.attention`; a paged ``k``/``v`` [num_blocks, page, Hk, D] is first
    gathered through ``block_table`` [B, max_blocks].

    Args:
      q: [total_q, H, D]; k, v: [total_k, Hk, D] (or paged). cu_seqlens_q, cu_seqlens_k: int [B + 1].
      scale, causal, window, softcap, align, dropout_p: the contract's keywords (``window`` with None
        for an unbounded side).
      return_lse: also return lse [H, total_q] (the contract's: -inf for a row that sees no key).

    Returns:
      ``out`` [total_q, H, D] (0 past ``cu_seqlens_q[-1]``), or ``(out, lse)``.
    """
    import flashport.torch

    if block_table is not None:
        k, v = paged_rows(k, block_table, cu_seqlens_k), paged_rows(v, block_table, cu_seqlens_k)
    band = dict(causal=causal, window=window, align=align)
    options = dict(scale=scale, softcap=softcap, return_lse=return_lse, **dropout_keywords(dropout_p))
    return attend_varlen(flashport.torch.attention, q, k, v, cu_seqlens_q, cu_seqlens_k, **band, **options)
