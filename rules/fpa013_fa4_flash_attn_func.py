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
    out, lse = flashport.torch.attention(q, k, v, scale=None, causal=True, window=(128, None), align="bottom_right", layout="BSHD", return_lse=True)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules import _fa3_fa4_common
from flashport.rules import _flash_attn as fa
from flashport.rules.base import Rewrite, Rule, Signature, build_call, is_none, register, string

MODULES = ("flash_attn.cute.", "flash_attn.cute.interface.")
KEYWORDS = (
    "qv",
    "gather_kv_indices",
    "softmax_scale",
    "causal",
    "window_size",
    "learnable_sink",
    "softcap",
    "num_splits",
    "pack_gqa",
    "deterministic",
    "score_mod",
    "score_mod_bwd",
    "mask_mod",
    "aux_tensors",
    "aux_scalars",
    "block_sparse_tensors",
    "block_sparse_tensors_bwd",
    "return_lse",
)
UNSUPPORTED = {
    "qv": "qv (extra query projection for MLA) has no portable equivalent",
    "gather_kv_indices": "gather_kv_indices (sparse KV gather) has no portable equivalent",
    "learnable_sink": "learnable_sink (attention sinks) has no portable equivalent",
    "score_mod": "score_mod callables have no portable equivalent",
    "score_mod_bwd": "score_mod callables have no portable equivalent",
    "mask_mod": "mask_mod callables have no portable equivalent",
    "aux_tensors": "aux_tensors (for score_mod/mask_mod) have no portable equivalent",
    "aux_scalars": "aux_scalars (for score_mod/mask_mod) have no portable equivalent",
    "block_sparse_tensors": "block-sparse attention has no portable equivalent",
    "block_sparse_tensors_bwd": "block-sparse attention has no portable equivalent",
}
TUNING = ("num_splits", "pack_gqa", "deterministic")
TUPLE_NOTE = "returns (out, lse): FA4 flash_attn_func always returns the tuple, whatever return_lse says"


def fa4_sources(function: str) -> tuple[str, ...]:
    """Every import path of an FA4 function."""
    return tuple(m + function for m in MODULES)


def fa4_keywords(bound, value, ctx, api) -> tuple[list, list[str]]:
    """Refuse FA4-only features; map scale/causal/window/softcap (FA4 window conventions)."""
    _fa3_fa4_common.refuse_set(value, UNSUPPORTED)
    notes = _fa3_fa4_common.dropped_notes(value, TUNING)
    plain = {n: bound[n] for n in ("softmax_scale", "causal", "softcap") if n in bound}
    keywords, more = _fa3_fa4_common.common(plain, ctx, api)
    window = value.get("window_size")
    if not is_none(window):
        mapped = _fa3_fa4_common.fa4_window(window)
        if mapped is not None:
            keywords.insert(2, ("window", mapped))
    return keywords, notes + more


@register
class FA4FlashAttnFunc(Rule):
    """Rewrite FlashAttention-4 ``flash_attn.cute.flash_attn_func`` to ``flashport.torch.attention``."""

    CODE = "FPA013"
    NAME = "fa4-flash-attn-func"
    API = "flash_attn.cute.flash_attn_func"
    FRAMEWORK = "torch"
    SOURCES = fa4_sources("flash_attn_func")
    TRIGGERS = (b"flash_attn",)
    GPU_MODULES = ("flash_attn",)
    TARGET = "flashport.torch.attention"

    def check_call(self, call, ctx):
        """Keywords only after q, k, v; FA4 window conventions; always ``(out, lse)`` like FA4."""
        _fa3_fa4_common.positional_limit(
            call,
            3,
            "arguments after v must be passed by keyword: FA4's 4th parameter is qv and its tail changed across betas",
        )
        bound = Signature(("q", "k", "v"), KEYWORDS).bind(call, self.API)
        q, k, v = fa.required(bound, ("q", "k", "v"), self.API)
        value = {name: arg.value for name, arg in bound.items()}
        keywords, notes = fa4_keywords(bound, value, ctx, self.API)
        keywords.append(("layout", string("BSHD")))
        keywords.append(("return_lse", cst.Name("True")))
        notes.append(TUPLE_NOTE)
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call), notes=tuple(notes))
