"""FlashAttention-3's drop-ins (:mod:`flashport.integrations.flash_attn.fa3`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import fa3
from flashport.integrations.flash_attn.fa3 import *  # noqa: F403

__all__ = fa3.__all__
