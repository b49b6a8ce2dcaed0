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

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common.binding import required
from flashport.rules.common.calls import build_call, string
from flashport.rules.flash_attn import arguments as fa


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class FlashAttnKVPackedFunc(Rule):
    """Rewrite flash-attn 2.x ``flash_attn_kvpacked_func`` to ``flashport.torch.attention``."""

    CODE = "FPA003"
    NAME = "flash-attn-kvpacked-func"
    API = "flash_attn.flash_attn_kvpacked_func"
    FRAMEWORK = "torch"
    SOURCES = fa.sources("flash_attn_kvpacked_func")
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.torch.attention"

    def check_call(self, call, ctx):
        """Split ``kv`` once and map the rest like FPA001."""
        splat = fa.splat_drop_in(call, ctx)
        if splat is not None:
            return splat
        bound = fa.signature(("q", "kv"), ctx.options.flash_attn_version).bind(call, self.API)
        q, kv = required(bound, ("q", "kv"), self.API)
        drop_in = fa.alibi_drop_in(call, bound, ctx, 2)
        drop_in = drop_in or fa.probs_drop_in(call, bound, ctx, 2)
        if drop_in is not None:
            return drop_in
        keywords, notes = fa.map_arguments(bound, ctx, self.API)
        positional = [q, fa.unbind(kv, 2)]
        carried = fa.dropout_or_drop_in(call, positional, keywords, bound, ctx, 2)
        if isinstance(carried, Rewrite):
            return carried
        keywords, more = carried
        node = build_call(self.TARGET, positional, keywords + [("layout", string("BSHD"))], call)
        notes += more
        return Rewrite(node, notes=tuple(notes))
