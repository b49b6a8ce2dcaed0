"""FPA011 fa3-flash-attn-varlen-func: FlashAttention-3 ``flash_attn_varlen_func`` -> ``flashport.varlen_attention``.

What it rewrites:
  ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, ...)`` from
  ``flash_attn_interface`` / ``flash_attn_3.flash_attn_interface`` / ``hopper.flash_attn_interface``.

Semantics mapping:
  as FA2 varlen (FPA004): ``[total, H, D]`` with int32 ``cu_seqlens`` -> ``layout="THD"``, causal and
  window bottom-right **per sequence**; ``max_seqlen_*`` and tuning arguments are dropped. Only the
  seven leading parameters may be positional (``seqused_q/k`` were inserted after them later).

  A thin wrapper's splat call (``out = f(*args, **kwargs)`` normalized by ``isinstance(out,
  tuple)`` right after it, as FPA010) goes to the drop-in
  ``flashport.integrations.flash_attn3_compat.flash_attn_varlen_func``, and the function passed to
  ``@functools.wraps(...)`` (only its name, docstring and signature are copied) becomes that drop-in.

What it refuses:
  ``seqused_q``/``seqused_k`` (per-sequence used lengths inside padded buffers), ``qv``, FP8
  descales, non-zero ``attention_chunk``, a result used as ``(out, lse)`` or
  ``return_attn_probs`` that is not literally False (``varlen_attention`` has no lse), a result whose
  type cannot be told, positional arguments after ``max_seqlen_k``, splats whose result is not
  normalized, ``return_softmax_lse=`` (a parameter of sgl-kernel's and other vendors' builds of
  ``flash_attn_interface``, not of FA3's), unknown arguments.

Example::

    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    out = out.transpose(0, 1)
    # becomes
    out = flashport.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, align="bottom_right", layout="THD")
"""

from __future__ import annotations

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature, required
from flashport.rules.common.calls import build_call, string
from flashport.rules.common.literals import is_none
from flashport.rules.flash_attn import fa3_fa4
from flashport.rules.flash_attn.fa3_fa4 import FA3_HISTORY, FA3_KEYWORDS, fa3_check_extras, fa3_sources

POSITIONAL = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class FA3FlashAttnVarlenFunc(Rule):
    """Rewrite FlashAttention-3 ``flash_attn_varlen_func`` to ``flashport.varlen_attention``."""

    CODE = "FPA011"
    NAME = "fa3-flash-attn-varlen-func"
    SOURCES = fa3_sources("flash_attn_varlen_func")
    TRIGGERS = (b"flash_attn_interface",)
    TARGET = "flashport.varlen_attention"

    def check_call(self, call, ctx):
        """Bind the stable prefix, refuse seqused/lse uses, map like FPA004."""
        if any(arg.keyword is not None and arg.keyword.value == "return_softmax_lse" for arg in call.args):
            raise Refuse(
                "return_softmax_lse= is not a parameter of FlashAttention-3's flash_attn_varlen_func "
                "(sgl-kernel's and other vendors' builds of flash_attn_interface take it and return "
                "(out, lse, *rest)): another API, not ported"
            )
        splat = fa3_fa4.fa3_splat_drop_in(call, ctx, "flash_attn_varlen_func")
        if splat is not None:
            return splat
        signature = Signature(
            POSITIONAL, ("seqused_q", "seqused_k", "softmax_scale", "causal") + FA3_KEYWORDS
        )
        fa3_fa4.positional_limit(
            call,
            len(POSITIONAL),
            "arguments after max_seqlen_k must be passed by keyword: FA3 inserted seqused_q/seqused_k there",
        )
        bound = signature.bind(call, self.API)
        q, k, v, cu_q, cu_k = required(bound, POSITIONAL[:5], self.API)
        value = {name: arg.value for name, arg in bound.items()}
        for name in ("seqused_q", "seqused_k"):
            if not is_none(value.get(name)):
                raise Refuse(
                    f"{name} (used lengths inside padded per-sequence buffers) has no portable equivalent"
                )
        notes = fa3_check_extras(value, ctx)
        if fa3_fa4.returns_tuple(call, ctx, value.get("return_attn_probs"), "return_attn_probs", FA3_HISTORY):
            return fa3_fa4.fa3_tuple_drop_in(call, "flash_attn_varlen_func", "lse [H, total_q]")
        keywords, more = fa3_fa4.common(bound, ctx, self.API)
        keywords = [("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)] + keywords + [("layout", string("THD"))]
        notes.append("dropped max_seqlen_q/max_seqlen_k (kernel launch sizes only)")
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call), notes=tuple(notes + more))
