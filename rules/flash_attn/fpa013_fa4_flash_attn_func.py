"""FPA013 fa4-flash-attn-func: FlashAttention-4 ``flash_attn.cute.flash_attn_func`` -> ``flashport.torch.attention``.

What it rewrites:
  ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
  softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, return_lse=False, ...)`` imported
  from ``flash_attn.cute`` or ``flash_attn.cute.interface`` (FA4 lives inside the ``flash_attn``
  namespace; FA2's ``flash_attn.flash_attn_func`` is FPA001).

Semantics mapping:
  ``[B, S, H, D]``, ``1/sqrt(D)`` default scale, **bottom-right** causal (``flash_attn/cute/mask.py``
  offsets by ``seqlen_k - seqlen_q``), contiguous GQA. ``window_size``: FA4 spells "unbounded"
  ``None`` (not -1) and resets ``(l, r)`` with ``l + r < 0`` to unbounded; literal windows map to
  the contract's ``window`` (inclusive, ``None`` = unbounded). ``softcap`` 0.0 = off. Only ``q, k,
  v`` may be positional (FA4's 4th parameter is ``qv`` and the tail changed across betas).
  FA4's ``flash_attn_func`` **always** returns ``(out, lse)`` (``return_lse`` only decides whether
  lse is computed), so every rewrite passes ``return_lse=True`` and returns the same tuple, whatever
  ``return_lse`` says. Tuning arguments are dropped.

What it refuses:
  ``qv``, ``gather_kv_indices``, ``learnable_sink``, ``score_mod``/``mask_mod``/``aux_*``,
  block-sparse tensors, non-literal or one-sided negative windows, splats, unknown arguments.

Example::

    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(128, None), return_lse=False)
    # becomes
    out, lse = flashport.torch.attention(q, k, v, causal=True, window=(128, None), align="bottom_right", layout="BSHD", return_lse=True)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common.binding import Signature, required
from flashport.rules.common.calls import build_call, string
from flashport.rules.flash_attn import fa3_fa4
from flashport.rules.flash_attn.fa3_fa4 import FA4_KEYWORDS, fa4_keywords, fa4_sources

TUPLE_NOTE = "returns (out, lse): FA4 flash_attn_func always returns the tuple, whatever return_lse says"


@register
class FA4FlashAttnFunc(Rule):
    """Rewrite FlashAttention-4 ``flash_attn.cute.flash_attn_func`` to ``flashport.torch.attention``."""

    CODE = "FPA013"
    NAME = "fa4-flash-attn-func"
    SOURCES = fa4_sources("flash_attn_func")
    TRIGGERS = (b"flash_attn",)
    TARGET = "flashport.torch.attention"

    def check_call(self, call, ctx):
        """Keywords only after q, k, v; FA4 window conventions; always ``(out, lse)`` like FA4."""
        fa3_fa4.positional_limit(
            call,
            3,
            "arguments after v must be passed by keyword: FA4's 4th parameter is qv and its tail changed across betas",
        )
        bound = Signature(("q", "k", "v"), FA4_KEYWORDS).bind(call, self.API)
        q, k, v = required(bound, ("q", "k", "v"), self.API)
        value = {name: arg.value for name, arg in bound.items()}
        keywords, notes = fa4_keywords(bound, value, ctx, self.API)
        keywords.append(("layout", string("BSHD")))
        keywords.append(("return_lse", cst.Name("True")))
        notes.append(TUPLE_NOTE)
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call), notes=tuple(notes))
