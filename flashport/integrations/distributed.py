"""``flash_attn.utils.distributed``'s drop-ins (:mod:`flashport.integrations.flash_attn.distributed`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import distributed
from flashport.integrations.flash_attn.distributed import *  # noqa: F403

__all__ = distributed.__all__
