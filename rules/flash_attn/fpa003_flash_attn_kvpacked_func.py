"""FPA003 flash-attn-kvpacked-func: ``flash_attn_kvpacked_func`` -> ``flashport.torch.attention``.

What it rewrites:
  ``flash_attn_kvpacked_func(q, kv, dropout_p, softmax_scale, causal, window_size, softcap,
  alibi_slopes, deterministic, return_attn_probs)`` from ``flash_attn`` /
  ``flash_attn.flash_attn_interface``.

Semantics mapping:
  ``q`` is ``[B, Sq, H, D]``, ``kv`` is ``[B, Sk, 2, Hk, D]``; ``kv`` is split once with
  ``*kv.unbind(2)`` (``layout="BSHD"``). Causal/window are bottom-right (``align="bottom_right"``),
  which matters here because Sq may differ from Sk (decode, chunked prefill). GQA: Hk divides H,
  contiguous groups, same as the contract. Rest as FPA001 (``dropout_p`` carried verbatim).

What it refuses:
  as FPA001 (ALiBi, splats and an out-of-order side-effecting dropout go to the
  ``flash_attn_kvpacked_func`` drop-in, as in FPA001).

Example::

    out = flash_attn_kvpacked_func(q, kv, causal=True)
    # becomes
    out = flashport.torch.attention(q, *kv.unbind(2), causal=True, align="bottom_right", layout="BSHD")
"""

from __future__ import annotations

from flashport.rules.base import register
from flashport.rules.flash_attn.dense_varlen import DenseRule


@register
class FlashAttnKVPackedFunc(DenseRule):
    """Rewrite flash-attn 2.x ``flash_attn_kvpacked_func`` to ``flashport.torch.attention``."""

    CODE = "FPA003"
    NAME = "flash-attn-kvpacked-func"
    FUNCTION = "flash_attn_kvpacked_func"
