"""``flashport.sdpa_mask``: torch SDPA's ``attn_mask`` as the contract's ``mask=`` or ``bias=``.

SDPA's ``attn_mask`` is either boolean (True = take part in attention) or a float tensor added to
the scores; the contract keeps them apart (``mask`` bool True = attend, ``bias`` additive). The
dtype is only known at run time, so rewritten SDPA calls pass ``**flashport.sdpa_mask(attn_mask)``.
"""

from __future__ import annotations


def sdpa_mask(attn_mask) -> dict:
    """``{"mask": m}`` for a boolean mask, ``{"bias": m}`` for a float one, ``{}`` for None."""
    if attn_mask is None:
        return {}
    dtype = str(getattr(attn_mask, "dtype", ""))
    if dtype in ("torch.bool", "bool"):
        return {"mask": attn_mask}
    return {"bias": attn_mask}
