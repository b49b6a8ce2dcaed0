"""FPA014 fa4-flash-attn-varlen-func: FlashAttention-4 ``flash_attn.cute.flash_attn_varlen_func`` -> flashport's FA4 drop-in.

What it rewrites:
  ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=..., cu_seqlens_k=..., softmax_scale=...,
  causal=..., window_size=..., softcap=...)`` from ``flash_attn.cute`` / ``flash_attn.cute.interface``.

Semantics mapping:
  ``[total, H, D]`` with ``cu_seqlens`` ``(B+1,)`` -> ``layout="THD"``; causal/window bottom-right
  **per sequence**; FA4 window conventions as FPA013; ``max_seqlen_*`` and tuning arguments dropped.
  Only ``q, k, v`` may be positional; ``cu_seqlens_q`` and ``cu_seqlens_k`` must be given.

  FA4's ``flash_attn_varlen_func`` always returns ``(out, lse)`` (whatever ``return_lse`` says), so
  the call keeps its arguments and goes to ``flashport.integrations.flash_attn4_compat.flash_attn_varlen_func``,
  which returns the same ``(out, lse [H, total_q])`` on the contract's varlen path. A
  ``*args``/``**kwargs`` splat (a thin wrapper) goes there too: the drop-in binds it at run time
  and its return never depends on the arguments.

What it refuses:
  what FPA013 refuses but splats, plus ``seqused_q``/``seqused_k``/``page_table`` (padded or paged
  buffers) and missing ``cu_seqlens_*``.

Example::

    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    # becomes
    out, lse = flashport.integrations.flash_attn4_compat.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
"""

from __future__ import annotations

from flashport.rules.base import Refuse, Rule, register
from flashport.rules.common.binding import Signature, required
from flashport.rules.common.calls import on_drop_in
from flashport.rules.common.literals import is_none
from flashport.rules.common.values import FA4
from flashport.rules.flash_attn import fa3_fa4
from flashport.rules.flash_attn.fa3_fa4 import FA4_KEYWORDS, fa4_keywords, fa4_sources

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
    SOURCES = fa4_sources("flash_attn_varlen_func")
    TRIGGERS = (b"flash_attn",)
    TARGET = f"{FA4}.flash_attn_varlen_func"

    def check_call(self, call, ctx):
        """Check the arguments like FPA013, then call the FA4 drop-in (it returns (out, lse) as FA4 does)."""
        if any(arg.star for arg in call.args):
            note = (
                "drop-in flash_attn_varlen_func: the *args/**kwargs splat is bound at run time (only q, k, v "
                "positional, as the drop-in takes them: more raise TypeError; FA4 features it lacks raise "
                "NotImplementedError); it returns (out, lse) as FA4 always does"
            )
            return on_drop_in(call, self.TARGET, note)
        fa3_fa4.positional_limit(
            call,
            3,
            "arguments after v must be passed by keyword: FA4's varlen signature changed across betas",
        )
        bound = Signature(("q", "k", "v"), VARLEN + FA4_KEYWORDS).bind(call, self.API)
        required(bound, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), self.API)
        value = {name: arg.value for name, arg in bound.items()}
        for name in ("seqused_q", "seqused_k", "page_table"):
            if not is_none(value.get(name)):
                raise Refuse(f"{name} (padded or paged per-sequence buffers) has no portable equivalent")
        fa4_keywords(bound, value, ctx, self.API)  # refuses unsupported features first
        note = "drop-in flash_attn_varlen_func: returns (out, lse [H, total_q]) as FA4 always does"
        return on_drop_in(call, self.TARGET, note)
