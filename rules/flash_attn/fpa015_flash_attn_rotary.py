"""FPA015 flash-attn-rotary: ``flash_attn.layers.rotary.apply_rotary_emb`` -> ``flashport.integrations.rotary``.

What it rewrites:
  calls and values of ``apply_rotary_emb`` and its alias ``apply_rotary_emb_func`` from
  ``flash_attn.layers.rotary``: flash-attn's Triton rotary kernel, imported next to the attention
  call in model code. Importing ``flash_attn.layers.rotary`` needs flash-attn (and Triton), so a
  file whose attention is ported would still need the GPU library for it.

Semantics mapping:
  the same function, arguments and result in plain torch (``flashport/integrations/rotary.py``:
  ``[B, S, H, D]`` or varlen ``[total, H, D]`` with ``cu_seqlens``, ``cos``/``sin`` ``[S_rotary,
  rotary_dim / 2]``, per-sequence ``seqlen_offsets``, GPT-NeoX halves or GPT-J pairs
  (``interleaved``), ``inplace``). The call keeps its arguments, their order and comments.

What it refuses:
  value uses that probe or compare the function (reported with the reason). The module's other
  names (``RotaryEmbedding``, ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``) are not covered:
  a file using them keeps its ``flash_attn`` import, which the results list.

Example::

    q = apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=offset)
    # becomes
    q = flashport.integrations.rotary.apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=offset)
"""

from __future__ import annotations

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common import values
from flashport.rules.common.calls import dotted

MODULE = "flashport.integrations.rotary"
FUNCTIONS = ("apply_rotary_emb", "apply_rotary_emb_func")


@register
class FlashAttnRotary(Rule):
    """Rewrite flash-attn's rotary embedding function to flashport's plain-torch drop-in."""

    CODE = "FPA015"
    NAME = "flash-attn-rotary"
    API = "flash_attn.layers.rotary.apply_rotary_emb"
    FRAMEWORK = "torch"
    SOURCES = tuple(f"flash_attn.layers.rotary.{name}" for name in FUNCTIONS)
    TRIGGERS = (b"rotary",)
    GPU_MODULES = ("flash_attn",)
    TARGET = MODULE + ".apply_rotary_emb"

    def check_call(self, call, ctx):
        """The same call on the drop-in of the same name."""
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        note = f"drop-in {name} (flash-attn's signature and result, plain torch)"
        return Rewrite(call.with_changes(func=dotted(f"{MODULE}.{name}")), imports=(MODULE,), notes=(note,))

    def check_reference(self, node, ctx):
        """A value is the drop-in of the same name unless it is probed or compared."""
        why = values.probe(ctx)
        if why is not None and not values.inspects_signature(ctx):
            return values.Report(f"{why}: not a call to port; kept")
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        note = f"{values.describe(node, ctx)}: the value is now flashport's drop-in {MODULE}.{name} (same signature)"
        return Rewrite(dotted(f"{MODULE}.{name}"), imports=(MODULE,), notes=(note,))
