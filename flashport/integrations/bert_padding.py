"""``flash_attn.bert_padding``'s drop-ins (:mod:`flashport.integrations.flash_attn.bert_padding`), at the import path ported code uses."""

from __future__ import annotations

from flashport.integrations.flash_attn import bert_padding
from flashport.integrations.flash_attn.bert_padding import *  # noqa: F403

__all__ = bert_padding.__all__
