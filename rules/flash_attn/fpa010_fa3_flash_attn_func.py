"""FPA010 fa3-flash-attn-func: FlashAttention-3 ``flash_attn_interface.flash_attn_func`` -> ``flashport.torch.attention``.

What it rewrites:
  ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, ...,
  window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
  deterministic=False, sm_margin=0, return_attn_probs=False)`` imported from ``flash_attn_interface``
  (Hopper build), ``flash_attn_3.flash_attn_interface`` or ``hopper.flash_attn_interface``.

Semantics mapping:
  as FA2 (FPA001): ``[B, S, H, D]``, ``1/sqrt(D)`` default scale, **bottom-right** causal and
  inclusive window (-1 = unbounded), softcap 0.0 = off, contiguous GQA. Only ``q, k, v,
  softmax_scale, causal`` may be positional -- **FA3's 4th positional is softmax_scale, FA2's is
  dropout_p**, and later FA3 releases inserted parameters. Return type: FA3 returned ``(out, lse)``
  before 2025-07-11, then ``out``, and ``(out, lse)`` again with ``return_attn_probs=True``; the
  rewrite returns ``(out, lse)`` (``return_lse=True``, the same ``lse[B, H, Sq]`` float32) when
  ``return_attn_probs=True`` or when the result is indexed/unpacked, and ``out`` when the flag is
  ``False`` or the result is only used as a tensor. ``num_splits``, ``pack_gqa``, ``sm_margin``,
  ``deterministic``, ``gqa_parallel`` are dropped (kernel tuning).

  A call with a ``*args``/``**kwargs`` splat (a thin wrapper ``def f(*args, **kwargs)``) goes to the
  drop-in ``flashport.integrations.flash_attn3_compat.flash_attn_func`` (FA3's signature, bound at
  run time) when the wrapper normalizes the result right after the call (``out = f(*args,
  **kwargs)`` then ``return out[0] if isinstance(out, tuple) else out``, or ``if isinstance(out,
  tuple):`` ending in ``return out[0]`` / ``out = out[0]``): it then works with either return type.

What it refuses:
  ``qv``, FP8 ``*_descale`` arguments, non-zero ``attention_chunk``, ``sink_token_length``,
  positional arguments after ``causal``, a result whose expected type cannot be told (e.g.
  ``return flash_attn_func(...)``), splats whose result is not normalized, unknown arguments.

Example::

    out, lse = flash_attn_func(q, k, v, causal=True)
    # becomes
    out, lse = flashport.torch.attention(q, k, v, causal=True, align="bottom_right", layout="BSHD", return_lse=True)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common.binding import Signature, required
from flashport.rules.common.calls import build_call, string
from flashport.rules.flash_attn import fa3_fa4
from flashport.rules.flash_attn.fa3_fa4 import FA3_HISTORY, FA3_KEYWORDS, fa3_check_extras, fa3_sources

POSITIONAL = ("q", "k", "v", "softmax_scale", "causal")


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class FA3FlashAttnFunc(Rule):
    """Rewrite FlashAttention-3 ``flash_attn_func`` to ``flashport.torch.attention``."""

    CODE = "FPA010"
    NAME = "fa3-flash-attn-func"
    SOURCES = fa3_sources("flash_attn_func")
    TRIGGERS = (b"flash_attn_interface",)
    TARGET = "flashport.torch.attention"

    def check_call(self, call, ctx):
        """Bind the stable prefix, refuse FA3-only features, pick the return type from the use."""
        splat = fa3_fa4.fa3_splat_drop_in(call, ctx, "flash_attn_func")
        if splat is not None:
            return splat
        fa3_fa4.positional_limit(
            call,
            len(POSITIONAL),
            "arguments after causal must be passed by keyword: FA3 inserted and renamed parameters between releases",
        )
        bound = Signature(POSITIONAL, FA3_KEYWORDS).bind(call, self.API)
        q, k, v = required(bound, ("q", "k", "v"), self.API)
        value = {name: arg.value for name, arg in bound.items()}
        notes = fa3_check_extras(value, ctx)
        keywords, more = fa3_fa4.common(bound, ctx, self.API)
        keywords.append(("layout", string("BSHD")))
        if fa3_fa4.returns_tuple(call, ctx, value.get("return_attn_probs"), "return_attn_probs", FA3_HISTORY):
            keywords.append(("return_lse", cst.Name("True")))
            notes.append("returns (out, lse) like the FA3 call it replaces")
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call), notes=tuple(notes + more))
