"""FPA009 flash-attn-bert-padding: ``flash_attn.bert_padding`` helpers -> ``flashport.integrations.bert_padding``.

What it rewrites:
  calls of ``unpad_input``, ``pad_input``, ``index_first_axis`` and ``index_put_first_axis`` from
  ``flash_attn.bert_padding`` (any import form). Importing ``flash_attn.bert_padding`` loads
  flash-attn's CUDA extension, so a file that only needs these plain-torch helpers would still
  need flash-attn; once every use is rewritten the engine drops the import. Used as values
  (dispatch tables, callbacks), they become the drop-ins of the same name too (``unpad_input``
  only from flash-attn 2.7, whose five return values the drop-in has).

Branches:
  a name bound to these helpers in one branch of an ``if``/``else`` and to another library's in the
  other (``if npu: from npu_utils import pad_input`` / ``else: from flash_attn.bert_padding import
  pad_input``, then ``pad_input`` read) is ported by re-pointing that branch's one-line import in the
  function at the drop-in module: every read of its names then gets the drop-in (the same functions
  for calls and values), the other branch stays (the engine's branch port). Not where the file
  compares a name, imports it twice, or before flash-attn 2.7 for ``unpad_input``.

Semantics mapping:
  the same functions, arguments and results, in plain torch (``flashport/integrations/bert_padding.py``):
  ``unpad_input`` packs the valid tokens and returns ``(hidden, indices, cu_seqlens, max_seqlen,
  seqused)`` as flash-attn >= 2.7 does; before 2.7 (``flash-attn-version``) flash-attn returned the
  first four, so the rewrite takes ``[:4]`` of the drop-in's result -- also when the result is
  unpacked into four names (code written for flash-attn < 2.7, which fails with 2.7's five).
  ``rearrange`` (``bert_padding`` re-exports einops') becomes the drop-in that calls einops. The
  call keeps its arguments, their order and comments.

What it refuses:
  ``unpad_input`` with a third argument (``unused_mask``) before flash-attn 2.7, which had none;
  other ``bert_padding`` names (``unpad_input_for_concatenated_sequences``...), and value uses that
  probe or compare the function, are reported, not rewritten.

Example::

    hidden, indices, cu_seqlens, max_len, _ = unpad_input(x, attention_mask)
    # becomes
    hidden, indices, cu_seqlens, max_len, _ = flashport.integrations.bert_padding.unpad_input(x, attention_mask)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.calls import dotted

MODULE = "flashport.integrations.bert_padding"
FUNCTIONS = ("unpad_input", "pad_input", "index_first_axis", "index_put_first_axis", "rearrange")
SEQUSED_VERSION = (2, 7)  # unpad_input gained unused_mask and a fifth result (seqused) in 2.7.0


def _unpacked_into(ctx) -> int | None:
    """How many plain names the call's result is unpacked into (None: not unpacked, or starred)."""
    up = ctx.ancestors[0] if ctx.ancestors else None
    if isinstance(up, cst.Assign) and up.value is ctx.node and len(up.targets) == 1:
        target = up.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and not any(
            isinstance(e, cst.StarredElement) for e in target.elements
        ):
            return len(target.elements)
    return None


@register
class FlashAttnBertPadding(Rule):
    """Rewrite ``flash_attn.bert_padding`` helper calls to flashport's plain-torch drop-ins."""

    CODE = "FPA009"
    NAME = "flash-attn-bert-padding"
    SOURCES = tuple(f"flash_attn.bert_padding.{name}" for name in FUNCTIONS)
    TRIGGERS = (b"bert_padding",)
    TARGET = MODULE + ".*"

    def check_call(self, call, ctx):
        """The same call on the drop-in; ``[:4]`` of ``unpad_input`` before flash-attn 2.7."""
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        new: cst.BaseExpression = call.with_changes(func=dotted(f"{MODULE}.{name}"))
        notes = [f"drop-in {name} (flash-attn's signature and results, plain torch)"]
        if name == "unpad_input" and ctx.options.flash_attn_version < SEQUSED_VERSION:
            if len(call.args) > 2 or any(arg.star for arg in call.args):
                raise Refuse(
                    "unpad_input before flash-attn 2.7 takes (hidden_states, attention_mask) only; "
                    "check the flash-attn version (--flash-attn-version)"
                )
            new = cst.Subscript(
                value=new,
                slice=[cst.SubscriptElement(cst.Slice(lower=None, upper=cst.Integer("4")))],
            )
            notes.append("[:4]: flash-attn < 2.7 returns four values (no seqused)")
        elif name == "unpad_input" and _unpacked_into(ctx) == 4:
            new = cst.Subscript(
                value=new,
                slice=[cst.SubscriptElement(cst.Slice(lower=None, upper=cst.Integer("4")))],
            )
            notes.append(
                "[:4]: the result is unpacked into four names, so the code was written for flash-attn < 2.7 "
                "(four results, no seqused)"
            )
        return Rewrite(new, imports=(MODULE,), notes=tuple(notes))
