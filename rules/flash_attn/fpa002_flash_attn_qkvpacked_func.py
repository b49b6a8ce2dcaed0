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

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common.binding import required
from flashport.rules.common.calls import build_call, string
from flashport.rules.flash_attn import arguments as fa


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class FlashAttnQKVPackedFunc(Rule):
    """Rewrite flash-attn 2.x ``flash_attn_qkvpacked_func`` to ``flashport.torch.attention``."""

    CODE = "FPA002"
    NAME = "flash-attn-qkvpacked-func"
    API = "flash_attn.flash_attn_qkvpacked_func"
    FRAMEWORK = "torch"
    SOURCES = fa.sources("flash_attn_qkvpacked_func")
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.torch.attention"

    def check_call(self, call, ctx):
        """Split the packed tensor once and map the rest like FPA001."""
        splat = fa.splat_drop_in(call, ctx)
        if splat is not None:
            return splat
        bound = fa.signature(("qkv",), ctx.options.flash_attn_version).bind(call, self.API)
        (qkv,) = required(bound, ("qkv",), self.API)
        drop_in = fa.alibi_drop_in(call, bound, ctx, 1)
        drop_in = drop_in or fa.probs_drop_in(call, bound, ctx, 1)
        if drop_in is not None:
            return drop_in
        keywords, notes = fa.map_arguments(bound, ctx, self.API)
        positional = [fa.unbind(qkv, 2)]
        carried = fa.dropout_or_drop_in(call, positional, keywords, bound, ctx, 1)
        if isinstance(carried, Rewrite):
            return carried
        keywords, more = carried
        node = build_call(self.TARGET, positional, keywords + [("layout", string("BSHD"))], call)
        notes += more
        return Rewrite(node, notes=tuple(notes))
