"""FlashAttention-3's drop-ins (:mod:`flashport.integrations.flash_attn.fa3`, its private kernels :mod:`~flashport.integrations.flash_attn.fa3_private`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import fa3, fa3_private
from flashport.integrations.flash_attn.fa3 import *  # noqa: F403
from flashport.integrations.flash_attn.fa3_private import *  # noqa: F403

__all__ = fa3.__all__ + fa3_private.__all__
