"""FPA015 flash-attn-rotary: ``flash_attn.layers.rotary`` -> ``flashport.integrations.rotary``.

What it rewrites:
  calls and values of ``apply_rotary_emb`` (and its alias ``apply_rotary_emb_func``),
  ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_`` and the ``RotaryEmbedding`` module (its
  construction, and the class as a value: a base class, a factory) from
  ``flash_attn.layers.rotary``: flash-attn's Triton rotary kernels, imported next to the attention
  call in model code. Importing ``flash_attn.layers.rotary`` needs flash-attn (and Triton), so a
  file whose attention is ported would still need the GPU library for it.

Semantics mapping:
  the same function, arguments and result in plain torch (``flashport/integrations/rotary.py``:
  ``[B, S, H, D]`` or varlen ``[total, H, D]`` with ``cu_seqlens``, ``cos``/``sin`` ``[S_rotary,
  rotary_dim / 2]``, per-sequence ``seqlen_offsets``, GPT-NeoX halves or GPT-J pairs
  (``interleaved``), ``inplace``); the packed ``qkv_``/``kv_`` variants rotate in place and return
  their input; ``RotaryEmbedding`` keeps flash-attn's constructor, ``forward``, buffers
  (``inv_freq``, ``scale``), cache attributes and private methods, so subclasses that override
  ``_update_cos_sin_cache`` behave alike. The call keeps its arguments, their order and comments.

What it refuses:
  value uses that probe or compare a function (reported with the reason). ``RotaryEmbedding``
  travels with its constructions: ``isinstance``/``issubclass`` checks and annotations name the
  drop-in class; where it stays flash-attn's (compared, listed in ``__all__``, inside an import
  guard), every rewrite of the file is refused, since the modules built there must pass that
  check. A module built by code left on flash-attn is not an instance of the drop-in class.

Example::

    q = apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=offset)
    # becomes
    q = flashport.integrations.rotary.apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=offset)
"""

from __future__ import annotations

from flashport.rules.base import Rewrite, RuleContext, register
from flashport.rules.common import values
from flashport.rules.flash_attn.same_name import SameNameRule

MODULE = "flashport.integrations.rotary"
CLASS = "RotaryEmbedding"
TYPE_CHECKS = ("inspected with isinstance(", "inspected with issubclass(")
FUNCTIONS = (
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_kv_",
    "RotaryEmbedding",
)


@register
class FlashAttnRotary(SameNameRule):
    """Rewrite flash-attn's rotary embedding functions and module to flashport's plain-torch drop-ins."""

    CODE = "FPA015"
    NAME = "flash-attn-rotary"
    SOURCES = tuple(f"flash_attn.layers.rotary.{name}" for name in FUNCTIONS)
    TRIGGERS = (b"rotary",)
    TARGET = MODULE + ".apply_rotary_emb"
    DROP_IN_MODULE = MODULE
    DROP_IN_KIND = "plain torch"

    def check_reference(self, node, ctx):
        """A value is the drop-in of the same name unless it is probed or compared; the class
        travels with its constructions into ``isinstance``/``issubclass`` checks."""
        why = values.probe(ctx)
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        if name == CLASS and why is not None and why.startswith(TYPE_CHECKS):
            note = f"{why}: the class is flashport's drop-in {MODULE}.{name}, as its constructions are"
            return Rewrite(self.drop_in(name), imports=(MODULE,), notes=(note,))
        return super().check_reference(node, ctx)

    def settle(self, sites, ctx):
        """Keep the file's rewrites when flash-attn's ``RotaryEmbedding`` stays somewhere in it (a
        comparison, ``__all__``, an import guard): a module built by the drop-in would then fail
        that check."""
        for site in sites:
            if site.rule == self.CODE and site.api.endswith("." + CLASS) and site.status != "rewrite":
                return (
                    f"{CLASS} on line {site.line} stays flash-attn's class; the rotary modules built "
                    "in this file must stay flash-attn's too"
                )
        if not any(s.rule == self.CODE and s.api.endswith("." + CLASS) for s in sites):
            return None
        line = _compared_class(ctx)
        if line is not None:
            return (
                f"{CLASS} is compared on line {line} (identity or equality with flash-attn's class); "
                "the rotary modules built in this file must stay flash-attn's too"
            )
        return None


def _compared_class(ctx: RuleContext) -> int | None:
    """The first line comparing a name imported for flash-attn's ``RotaryEmbedding`` (``type(m) is
    RotaryEmbedding``), which the rule sees no value site for."""
    names = {
        b.name
        for b in ctx.imports()
        if b.is_from and b.from_module == "flash_attn.layers.rotary" and b.alias.name == CLASS
    }
    return ctx.first_comparison(names)
