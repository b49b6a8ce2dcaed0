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

  A call that passes ``return_softmax_lse=`` (not a parameter of FA3's) was written for sgl-kernel's
  build of ``flash_attn_interface`` (vendor builds copy it: ``page_table`` after ``seqused_k``,
  ``return_softmax_lse`` for ``return_attn_probs``, ``sinks``, ``out``): it goes to the drop-in
  ``flash_attn3_compat.sgl_flash_attn_varlen_func``, which has that signature and returns ``out``, or
  ``(out, lse, *rest)`` when ``return_softmax_lse`` is true at run time, as that build does; its
  ``**kwargs`` splat is bound at run time. So does any call of the name when the file also binds it
  to sgl-kernel's ``sgl_kernel.flash_attn.flash_attn_varlen_func`` (another platform's branch of the
  import).

What it refuses:
  ``seqused_q``/``seqused_k`` (per-sequence used lengths inside padded buffers), ``qv``, FP8
  descales, non-zero ``attention_chunk``, a result used as ``(out, lse)`` or
  ``return_attn_probs`` that is not literally False (``varlen_attention`` has no lse), a result whose
  type cannot be told, positional arguments after ``max_seqlen_k``, splats whose result is not
  normalized, unknown arguments; for sgl-kernel's build also ``seqused_*``, ``page_table``,
  ``sinks`` and ``out`` given statically, and positional arguments after ``max_seqlen_k``.

Example::

    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    out = out.transpose(0, 1)
    # becomes
    out = flashport.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, align="bottom_right", layout="THD")
"""

from __future__ import annotations

import libcst as cst

from flashport.rules import apis
from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature, required
from flashport.rules.common.calls import build_call, on_drop_in, string
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
            return _sgl_build(call, ctx)
        if _also_sgl_kernel(call, ctx):
            return _sgl_build(
                call,
                ctx,
                "the file binds this name to sgl-kernel's flash_attn_varlen_func in another branch "
                "(another platform's build), so the call is written for that build's convention",
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


SGL_API = "sglang.kernels.ops.attention.flash_attention_v3.flash_attn_varlen_func"
SGL_DROP_IN = f"{fa3_fa4.FA3_COMPAT}.sgl_flash_attn_varlen_func"
# sgl-kernel's builds: the same return convention and parameter names (a subset of the drop-in's)
SGL_BUILDS = frozenset(
    (
        SGL_API,
        "sglang.kernels.ops.attention.flash_attention.flash_attn_varlen_func",
        "sgl_kernel.flash_attn.flash_attn_varlen_func",
    )
)


def _also_sgl_kernel(call, ctx) -> bool:
    """Whether the file binds the called name to one of sgl-kernel's ``flash_attn_varlen_func`` builds
    too (in its module scope: the platform branches of one import site)."""
    model = ctx.semantic
    if model is None or not isinstance(call.func, cst.Name):
        return False
    return any(getattr(b, "qualified", None) in SGL_BUILDS for b in model.binding(call.func.value))


def _sgl_build(call, ctx, why: str = "return_softmax_lse= is that build's parameter, not FA3's") -> Rewrite:
    """A call written for sgl-kernel's build of ``flash_attn_interface`` (vendor builds copy it;
    ``why``: how the call shows it), on the drop-in with that build's signature, which
    returns ``out`` or ``(out, lse, *rest)`` as that keyword says at run time. A ``**kwargs`` splat
    is bound by the drop-in at run time (an unknown key raises TypeError, an unsupported feature
    NotImplementedError).

    Raises:
      Refuse: a positional argument after ``max_seqlen_k`` (sgl-kernel put ``page_table`` where FA3
        has ``softmax_scale``), unknown keywords, statically given FA3-only features.
    """
    fa3_fa4.positional_limit(
        call,
        len(POSITIONAL),
        "arguments after max_seqlen_k must be passed by keyword: sgl-kernel's and FA3's builds differ there",
    )
    signature = Signature.of(apis.api(SGL_API).signature_at((0, 5, 23)) or ())
    bound = signature.bind(call.with_changes(args=[a for a in call.args if not a.star]), SGL_API)
    value = {name: arg.value for name, arg in bound.items()}
    for name in ("seqused_q", "seqused_k", "page_table", "sinks", "out"):
        if not is_none(value.get(name)):
            raise Refuse(f"{name}= (sgl-kernel's build): no portable equivalent in flashport's drop-in")
    notes = fa3_check_extras(value, ctx)
    splat = any(arg.star for arg in call.args)
    note = (
        "drop-in sgl_flash_attn_varlen_func: sgl-kernel's (and its vendor copies') build of "
        "flash_attn_interface, whose result is out, or (out, lse, *rest) when "
        "return_softmax_lse is true at run time"
        + f" ({why})"
        + ("; the **kwargs splat is bound at run time" if splat else "")
    )
    return on_drop_in(call, SGL_DROP_IN, note, *notes)
