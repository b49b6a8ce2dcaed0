"""FPA207 keras-dpa-flash: ``keras.ops.dot_product_attention(flash_attention=...)`` -> ``flashport.attention``.

What it rewrites:
  keras 3 ``dot_product_attention(query, key, value, bias=None, mask=None, scale=None,
  is_causal=False, flash_attention=None, attn_logits_soft_cap=None)`` (``keras.ops``,
  ``keras.ops.nn``, ``from keras import ops`` then ``ops.dot_product_attention``) when
  ``flash_attention`` is ``True`` or not a literal: those calls ask for cuDNN on GPU (and raise
  on CPU). Calls with ``flash_attention`` absent/None/False let keras pick a kernel per platform
  and are left alone (not reported).

Semantics mapping:
  layout ``(B, T, N, H)`` -> ``layout="BSHD"``; ``scale=None`` = 1/sqrt(H) -> ``scale``;
  ``is_causal`` (top-left on the JAX backend, which calls ``jax.nn.dot_product_attention``) ->
  ``causal=..., align="top_left"``; ``mask`` (bool, True = attend) -> ``mask``; ``bias``
  (additive) -> ``bias``; both broadcast to ``(B, N, T, S)``; GQA is the same. ``flash_attention``
  only selects a kernel (the result does not depend on it), so it is dropped.

What it refuses:
  ``attn_logits_soft_cap`` (keras documents ``logits / (1 + |logits| / cap)`` while its TPU
  splash kernel applies ``cap * tanh(logits / cap)``; which one a site means is ambiguous); a scale
  computed with array ops (the contract needs a static float); splats; unknown arguments.

Known problems:
  the rewrite is JAX code: it assumes the keras JAX backend (``KERAS_BACKEND=jax``); deselect
  FPA207 for code that runs on keras' torch or tensorflow backends. Symbolic ``KerasTensor``
  inputs (functional model construction) are not supported by ``flashport.attention``.

Example::

    out = ops.dot_product_attention(q, k, v, mask=m, flash_attention=True)
    # becomes
    out = flashport.attention(q, k, v, mask=m, align="top_left", layout="BSHD")
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import build_call, string
from flashport.rules.common.literals import is_none, literal_bool
from flashport.rules.jax import shared as common

SIGNATURE = Signature(
    ("query", "key", "value", "bias", "mask", "scale", "is_causal", "flash_attention", "attn_logits_soft_cap")
)


@register
class KerasDotProductAttentionFlash(Rule):
    """Rewrite keras' flash-requesting ``dot_product_attention`` calls to ``flashport.attention``."""

    CODE = "FPA207"
    NAME = "keras-dpa-flash"
    SOURCES = (
        "keras.ops.dot_product_attention",
        "keras.ops.nn.dot_product_attention",
        "keras.src.ops.nn.dot_product_attention",
    )
    TARGET = "flashport.attention"

    def check_call(self, call, ctx):
        """Only ``flash_attention=True`` (or dynamic) calls are GPU-specific; map them to the contract."""
        value = {name: arg.value for name, arg in SIGNATURE.bind(call, self.API).items()}
        flash = value.get("flash_attention")
        if is_none(flash) or literal_bool(flash) is False:
            return None
        query, key, val = common.require(value, ("query", "key", "value"), self.API)
        if not is_none(value.get("attn_logits_soft_cap")):
            raise Refuse(
                "attn_logits_soft_cap: keras' documented formula (x / (1 + |x| / cap)) and its TPU kernel's (cap * tanh(x / cap)) differ"
            )
        keywords: list = [
            ("scale", common.static_scale(value.get("scale"), cst.Name("None"), ctx, "scale")),
            ("causal", value.get("is_causal", cst.Name("False"))),
        ]
        for name in ("bias", "mask"):
            if not is_none(value.get(name)):
                keywords.append((name, value[name]))
        keywords += [("align", string("top_left")), ("layout", string("BSHD"))]
        return Rewrite(
            build_call(self.TARGET, [query, key, val], keywords, call),
            notes=("dropped flash_attention= (kernel choice only)",),
        )
