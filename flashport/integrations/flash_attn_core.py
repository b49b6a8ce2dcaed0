"""The flash-attn drop-ins' shared conversions (:mod:`flashport.integrations.flash_attn.core`), at
their earlier import path."""

from __future__ import annotations

from flashport.integrations.flash_attn.core import (
    alibi_bias,
    flash_attn_window,
    kvcache_mask,
    lse_like_flash_attn,
)

__all__ = ["alibi_bias", "flash_attn_window", "kvcache_mask", "lse_like_flash_attn"]
