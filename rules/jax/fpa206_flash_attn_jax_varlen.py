"""FPA206 flash-attn-jax-varlen: ``flash_attn_jax.flash_mha_varlen`` -> ``flashport.varlen_attention``.

What it rewrites:
  ``flash_mha_varlen(q, k, v, seqlens_q, seqlens_k=None, *, max_seqlen_q=-1, max_seqlen_k=-1,
  softmax_scale=None, is_causal=False, window_size=(-1, -1))`` (flash-attn-jax 0.6.2; older
  releases take the keywords positionally and add ``seqused_k``, ``zero_tensors``,
  ``deterministic``).

Semantics mapping:
  packed ``[total, h, d]`` tensors -> ``layout="THD"``; **``seqlens_q``/``seqlens_k`` are cumulative
  fence-posts** ``(b+1,)`` despite the name (``b = seqlens_q.shape[0] - 1``) -> ``cu_seqlens_q`` /
  ``cu_seqlens_k``; ``seqlens_k=None`` means ``seqlens_q`` (the package does exactly that);
  ``softmax_scale``, ``is_causal`` and ``window_size`` as in FPA205, per sequence and bottom-right
  aligned (offset ``len_k[b] - len_q[b]``, which :func:`flashport.varlen_attention` builds from the
  fence-posts). ``max_seqlen_*`` are launch hints and are dropped; so are ``zero_tensors=False`` and
  ``deterministic`` (backward-only).

What it refuses:
  positional arguments after ``seqlens_k`` (their order differs between releases);
  ``seqused_k``; ``zero_tensors`` that may be true; ``seqlens_k=None`` when ``seqlens_q`` is an
  expression (it would be evaluated twice); a non-literal ``window_size``; a scale computed with
  array ops; splats; unknown arguments.

Example::

    out = flash_mha_varlen(q, k, v, cu, is_causal=True, max_seqlen_q=128)
    # becomes
    out = flashport.varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, align="bottom_right", layout="THD")
"""

from __future__ import annotations

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import build_call, string
from flashport.rules.common.literals import is_none, literal_bool
from flashport.rules.jax import shared as common

SIGNATURE = Signature(
    ("q", "k", "v", "seqlens_q", "seqlens_k"),
    (
        "seqused_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "softmax_scale",
        "is_causal",
        "window_size",
        "zero_tensors",
        "deterministic",
    ),
)
DROPPED = ("max_seqlen_q", "max_seqlen_k", "zero_tensors", "deterministic")


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class FlashAttnJaxVarlen(Rule):
    """Rewrite ``flash_attn_jax.flash_mha_varlen`` to ``flashport.varlen_attention``."""

    CODE = "FPA206"
    NAME = "flash-attn-jax-varlen"
    SOURCES = ("flash_attn_jax.flash_mha_varlen", "flash_attn_jax.varlen.flash_mha_varlen")
    GPU_MODULES = ("flash_attn_jax",)
    TARGET = "flashport.varlen_attention"

    def check_call(self, call, ctx):
        """Pass the cumulative fence-posts as ``cu_seqlens_*``; per-sequence bottom-right masks."""
        value = {name: arg.value for name, arg in SIGNATURE.bind(call, self.API).items()}
        q, k, v, cu_q = common.require(value, ("q", "k", "v", "seqlens_q"), self.API)
        if not is_none(value.get("seqused_k")):
            raise Refuse("seqused_k: per-sequence used key counts are not mapped to varlen_attention")
        zero = value.get("zero_tensors")
        if zero is not None and literal_bool(zero) is not False:
            raise Refuse("zero_tensors may be True; not mapped")
        cu_k = value.get("seqlens_k")
        if is_none(cu_k):
            if not common.simple(cu_q):
                raise Refuse(
                    "seqlens_k=None with an expression for seqlens_q: it would be evaluated twice; bind it to a name first"
                )
            cu_k = cu_q
        keywords = [("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)] + common.fa_keywords(value, ctx, self.API)
        keywords += [("align", string("bottom_right")), ("layout", string("THD"))]
        dropped = [name for name in DROPPED if name in value]
        notes = (f"dropped {', '.join(dropped)} (launch hints / backward-only)",) if dropped else ()
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call), notes=notes)
