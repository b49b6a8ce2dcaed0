"""FPA002 flash-attn-qkvpacked-func: ``flash_attn_qkvpacked_func`` -> ``flashport.torch.attention``.

What it rewrites:
  ``flash_attn_qkvpacked_func(qkv, dropout_p, softmax_scale, causal, window_size, softcap,
  alibi_slopes, deterministic, return_attn_probs)`` from ``flash_attn`` /
  ``flash_attn.flash_attn_interface``.

Semantics mapping:
  ``qkv`` is ``[B, S, 3, H, D]``; it is split once with ``*qkv.unbind(2)`` into BSHD q, k, v
  (``layout="BSHD"``). Sq == Sk, so alignment does not change the result, but it is stated
  (``align="bottom_right"``). Everything else as FPA001 (dropout_p carried verbatim, scale, causal,
  window, softcap).

What it refuses:
  as FPA001: ``return_attn_probs``, unknown arguments (ALiBi, splats and an out-of-order
  side-effecting dropout go to the ``flash_attn_qkvpacked_func`` drop-in, as in FPA001).

Example::

    out = flash_attn_qkvpacked_func(qkv, 0.0, causal=True)
    # becomes
    out = flashport.torch.attention(*qkv.unbind(2), causal=True, align="bottom_right", layout="BSHD")
"""

from __future__ import annotations

from flashport.rules.base import register
from flashport.rules.flash_attn.dense_varlen import DenseRule


@register
class FlashAttnQKVPackedFunc(DenseRule):
    """Rewrite flash-attn 2.x ``flash_attn_qkvpacked_func`` to ``flashport.torch.attention``."""

    CODE = "FPA002"
    NAME = "flash-attn-qkvpacked-func"
    FUNCTION = "flash_attn_qkvpacked_func"
