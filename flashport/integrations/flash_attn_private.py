"""flash-attn 2's private kernel drop-ins (:mod:`flashport.integrations.flash_attn.private`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import private
from flashport.integrations.flash_attn.private import *  # noqa: F403

__all__ = private.__all__
