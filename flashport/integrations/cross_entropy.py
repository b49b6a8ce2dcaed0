"""``flash_attn.ops.triton.cross_entropy``'s drop-ins (:mod:`flashport.integrations.flash_attn.cross_entropy`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import cross_entropy
from flashport.integrations.flash_attn.cross_entropy import *  # noqa: F403

__all__ = cross_entropy.__all__
