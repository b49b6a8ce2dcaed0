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
  missing ``cu_seqlens_*`` -- and, for now, **every** call: FA4's ``flash_attn_varlen_func`` always
  returns ``(out, lse)`` (whatever ``return_lse`` says) and ``flashport.varlen_attention`` returns
  no lse, so no rewrite keeps the result's meaning. The argument checks run first so the reason
  names the first real obstacle.

Example::

    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    # is refused: FA4 returns (out, lse) and flashport.varlen_attention has no lse
"""

from __future__ import annotations

from flashport.rules import _fa3_fa4_common
from flashport.rules import _flash_attn as fa
from flashport.rules._fa3_fa4_common import FA4_KEYWORDS, fa4_keywords, fa4_sources
from flashport.rules.base import Refuse, Rule, Signature, is_none, register

VARLEN = (
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "seqused_q",
    "seqused_k",
    "page_table",
)


@register
class FA4FlashAttnVarlenFunc(Rule):
    """Check FlashAttention-4 ``flash_attn_varlen_func`` calls and refuse them with the first obstacle."""

    CODE = "FPA014"
    NAME = "fa4-flash-attn-varlen-func"
    API = "flash_attn.cute.flash_attn_varlen_func"
    FRAMEWORK = "torch"
    SOURCES = fa4_sources("flash_attn_varlen_func")
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.varlen_attention"
    REWRITES = False  # until varlen_attention returns lse: FA4's result is always (out, lse)

    def check_call(self, call, ctx):
        """Check the arguments like FPA013, then refuse: FA4 returns (out, lse), varlen_attention no lse."""
        _fa3_fa4_common.positional_limit(
            call,
            3,
            "arguments after v must be passed by keyword: FA4's varlen signature changed across betas",
        )
        bound = Signature(("q", "k", "v"), VARLEN + FA4_KEYWORDS).bind(call, self.API)
        fa.required(bound, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), self.API)
        value = {name: arg.value for name, arg in bound.items()}
        for name in ("seqused_q", "seqused_k", "page_table"):
            if not is_none(value.get(name)):
                raise Refuse(f"{name} (padded or paged per-sequence buffers) has no portable equivalent")
        fa4_keywords(bound, value, ctx, self.API)  # refuses unsupported features first
        raise Refuse(
            "FA4 flash_attn_varlen_func always returns (out, lse) and flashport.varlen_attention returns no lse"
        )
