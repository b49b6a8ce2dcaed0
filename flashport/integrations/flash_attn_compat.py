"""flash-attn 2.x's public namespace on flashport (the import path ported code uses).

Re-exports the FA1/FA2 functions and :func:`kvcache_attention` (:mod:`.flash_attn.fa2`),
``flash_attn_with_kvcache`` (:mod:`.flash_attn.kvcache`), the ``bert_padding`` helpers, the private
kernels of every release (:mod:`.flash_attn.private`) and ``kvcache_mask``.
"""

from __future__ import annotations

from flashport.integrations.flash_attn import fa2, private
from flashport.integrations.flash_attn.bert_padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
)
from flashport.integrations.flash_attn.core import alibi_bias as alibi_bias
from flashport.integrations.flash_attn.core import flash_attn_window as flash_attn_window
from flashport.integrations.flash_attn.core import kvcache_mask
from flashport.integrations.flash_attn.core import lse_like_flash_attn as lse_like_flash_attn
from flashport.integrations.flash_attn.core import varlen_core as varlen_core
from flashport.integrations.flash_attn.fa2 import *  # noqa: F403
from flashport.integrations.flash_attn.kvcache import flash_attn_with_kvcache
from flashport.integrations.flash_attn.private import *  # noqa: F403

__all__ = [
    *fa2.__all__,
    *private.__all__,
    "flash_attn_with_kvcache",
    "index_first_axis",
    "index_put_first_axis",
    "kvcache_mask",
    "pad_input",
    "unpad_input",
]
