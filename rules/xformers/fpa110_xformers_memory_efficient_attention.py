"""FPA110 xformers-memory-efficient-attention: ``xformers.ops.memory_efficient_attention`` -> flashport.

What it rewrites:
  ``memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None,
  output_dtype=None)`` (and ``memory_efficient_attention_forward``, same arguments) imported from
  ``xformers.ops`` or ``xformers.ops.fmha`` (``import xformers.ops as xops`` included), into
  ``flashport.integrations.xformers_compat.memory_efficient_attention`` with the same arguments.

Semantics mapping:
  layout ``[B, M, H, K]`` (3-D ``[B, M, K]`` = one head, 5-D ``[B, M, G, H, K]`` = GQA with expanded
  K/V) is kept; ``scale=None`` is ``K ** -0.5`` in both. ``attn_bias`` is converted at run time
  (its class is rarely visible at the call): ``LowerTriangularMask`` -> **top-left** causal,
  ``...FromBottomRight...`` -> bottom-right, ``LocalAttentionFromBottomRightMask(l, r)`` -> window
  ``(l, r)``, ``BlockDiagonal*`` -> segment ids (+ per-block causal/window), a tensor -> additive
  ``bias``; bias objects are built with flashport's mirror classes (FPA111) or read from real xformers
  objects. ``op=`` (kernel choice) is dropped; ``output_dtype`` is kept; dropout ``p`` is kept verbatim (the
  drop-in passes it to ``flashport.torch.attention(dropout_p=p)``: same scaling, default generator;
  a literal 0 is dropped, ``--inference`` drops a training-gated one).

What it refuses:
  a dropout ``p`` with side effects that the rewrite would evaluate out of its source order, an
  ``attn_bias`` expression naming a padded/paged/gappy block mask (see FPA111), splats,
  unknown arguments. ``memory_efficient_attention_partial`` /
  ``_backward`` are reported, not rewritten (partial results + LSE merging / a raw backward).

Example::

    y = xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask())
    # becomes (FPA111 rewrites the bias constructor)
    y = flashport.integrations.xformers_compat.memory_efficient_attention(q, k, v, attn_bias=flashport.integrations.xformers_compat.LowerTriangularMask())
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature, carry_dropout, required
from flashport.rules.common.calls import build_call, insert_in_source_order
from flashport.rules.common.literals import is_none
from flashport.rules.xformers.names import UNSUPPORTED

MODULE = "flashport.integrations.xformers_compat"
PREFIXES = ("xformers.ops.", "xformers.ops.fmha.")
REWRITTEN = ("memory_efficient_attention", "memory_efficient_attention_forward")
REPORTED = (
    "memory_efficient_attention_partial",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_forward_requires_grad",
)
SIGNATURE = Signature(("query", "key", "value", "attn_bias", "p", "scale"), ("op", "output_dtype"))


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class XformersMemoryEfficientAttention(Rule):
    """Rewrite ``xformers.ops.memory_efficient_attention`` to flashport's drop-in."""

    CODE = "FPA110"
    NAME = "xformers-memory-efficient-attention"
    SOURCES = tuple(p + f for f in REWRITTEN + REPORTED for p in PREFIXES)
    TRIGGERS = (b"memory_efficient_attention",)
    TARGET = MODULE + ".memory_efficient_attention"

    def check_call(self, call, ctx):
        """Keep q/k/v/attn_bias/p/scale/output_dtype (dropout ``p`` verbatim); drop op."""
        if ctx.qualified_name.rsplit(".", 1)[-1] in REPORTED:
            raise Refuse(
                f"{ctx.qualified_name.rsplit('.', 1)[-1]} (partial results or a raw backward) has no flashport equivalent"
            )
        bound = SIGNATURE.bind(call, self.API)
        q, k, v = required(bound, ("query", "key", "value"), self.API)
        value = {name: arg.value for name, arg in bound.items()}
        dropout, notes = carry_dropout(value.get("p"), "p", "p", ctx)
        if "op" in value and not is_none(value["op"]):
            notes.append("dropped op= (xformers kernel choice)")
        bias = value.get("attn_bias")
        if bias is not None:
            text = ctx.code(bias)
            bad = next((name for name in UNSUPPORTED if name in text), None)
            if bad:
                raise Refuse(
                    f"attn_bias {bad}: padded, paged or gappy block layouts have no flashport equivalent"
                )
        keywords: list[tuple[str, cst.BaseExpression]] = []
        for name in ("attn_bias", "scale", "output_dtype"):
            if name in value and not is_none(value[name]):
                keywords.append((name, value[name]))
        for entry in dropout:
            keywords = insert_in_source_order(call, [q, k, v], keywords, entry, "p", ctx)
        return Rewrite(
            build_call(self.TARGET, [q, k, v], keywords, call), imports=(MODULE,), notes=tuple(notes)
        )
