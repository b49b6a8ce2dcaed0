"""FlashAttention-4's drop-ins (:mod:`flashport.integrations.flash_attn.fa4`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import fa4
from flashport.integrations.flash_attn.fa4 import *  # noqa: F403
from flashport.integrations.flash_attn.fa4 import TUNING as TUNING
from flashport.integrations.flash_attn.fa4 import fa4_window as fa4_window

__all__ = fa4.__all__
