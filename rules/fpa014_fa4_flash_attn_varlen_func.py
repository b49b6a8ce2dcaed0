"""FPA014 fa4-flash-attn-varlen-func: FlashAttention-4 ``flash_attn.cute.flash_attn_varlen_func`` -> ``flashport.varlen_attention``.

What it rewrites:
  ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=..., cu_seqlens_k=..., softmax_scale=...,
  causal=..., window_size=..., softcap=...)`` from ``flash_attn.cute`` / ``flash_attn.cute.interface``.

Semantics mapping:
  ``[total, H, D]`` with ``cu_seqlens`` ``(B+1,)`` -> ``layout="THD"``; causal/window bottom-right
  **per sequence**; FA4 window conventions as FPA013; ``max_seqlen_*`` and tuning arguments dropped.
  Only ``q, k, v`` may be positional; ``cu_seqlens_q`` and ``cu_seqlens_k`` must be given.

What it refuses:
  what FPA013 refuses, plus ``seqused_q``/``seqused_k``/``page_table`` (padded or paged buffers),
  missing ``cu_seqlens_*``, and a result used as ``(out, lse)`` or ``return_lse`` not literally
  False (``varlen_attention`` has no lse).

Example::

    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True).float()
    # becomes
    out = flashport.varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, scale=None, causal=True, align="bottom_right", layout="THD").float()
"""

from __future__ import annotations

from flashport.rules import _fa34
from flashport.rules import _flash_attn as fa
from flashport.rules.base import Refuse, Rewrite, Rule, Signature, build_call, is_none, register, string
from flashport.rules.fpa013_fa4_flash_attn_func import HISTORY, KEYWORDS, fa4_keywords, fa4_sources

VARLEN = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q", "seqused_k", "page_table")


@register
class FA4FlashAttnVarlenFunc(Rule):
    """Rewrite FlashAttention-4 ``flash_attn_varlen_func`` to ``flashport.varlen_attention``."""

    CODE = "FPA014"
    NAME = "fa4-flash-attn-varlen-func"
    API = "flash_attn.cute.flash_attn_varlen_func"
    FRAMEWORK = "torch"
    SOURCES = fa4_sources("flash_attn_varlen_func")
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.varlen_attention"

    def check_call(self, call, ctx):
        """Require both cu_seqlens, refuse padded/paged buffers and lse uses, map like FPA013."""
        _fa34.positional_limit(call, 3, "arguments after v must be passed by keyword: FA4's varlen signature changed across betas")
        bound = Signature(("q", "k", "v"), VARLEN + KEYWORDS).bind(call, self.API)
        q, k, v, cu_q, cu_k = fa.required(bound, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), self.API)
        value = {name: arg.value for name, arg in bound.items()}
        for name in ("seqused_q", "seqused_k", "page_table"):
            if not is_none(value.get(name)):
                raise Refuse(f"{name} (padded or paged per-sequence buffers) has no portable equivalent")
        keywords, notes = fa4_keywords(bound, value, ctx, self.API)
        if _fa34.returns_tuple(call, ctx, value.get("return_lse"), "return_lse", HISTORY):
            raise Refuse("the caller expects (out, lse); flashport.varlen_attention returns no lse")
        keywords = [("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)] + keywords + [("layout", string("THD"))]
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call), notes=tuple(notes))
