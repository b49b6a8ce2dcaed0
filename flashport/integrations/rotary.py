"""``flash_attn.layers.rotary``'s drop-ins (:mod:`flashport.integrations.flash_attn.rotary`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import rotary
from flashport.integrations.flash_attn.rotary import *  # noqa: F403

__all__ = rotary.__all__
