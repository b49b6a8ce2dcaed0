"""The shared core of the flash-attn drop-ins: flash-attn's conventions in the contract's terms.

Every flash-attn drop-in (``flash_attn_compat``, ``flash_attn_private``, ``flash_attn3_compat`` and
the kvcache modules) reads flash-attn's window, lse, ALiBi and cache conventions from here, so each
conversion is defined once and no module imports another's private names.
"""

from __future__ import annotations

from flashport.kernels.semantics.visibility import band_visible


def flash_attn_window(window_size):
    """flash-attn ``window_size=(l, r)`` (-1 = unbounded) as the contract's ``window`` (or None)."""
    left, right = (int(w) for w in window_size)
    if left < 0 and right < 0:
        return None
    return (None if left < 0 else left, None if right < 0 else right)


def lse_like_flash_attn(lse):
    """The contract's lse with flash-attn's value for a row that sees no key (+inf, not -inf)."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


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
