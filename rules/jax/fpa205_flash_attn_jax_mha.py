"""FPA205 flash-attn-jax-mha: ``flash_attn_jax.flash_mha`` -> ``flashport.attention``.

What it rewrites:
  ``flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1))`` from the
  flash-attn-jax package (``from flash_attn_jax import flash_mha``; also ``flash_attn_jax.flash``).

Semantics mapping:
  layout ``[n, l, h, d]`` -> ``layout="BSHD"``; ``softmax_scale=None`` = 1/sqrt(d) -> ``scale``;
  ``is_causal`` (note the name) -> ``causal`` with ``align="bottom_right"`` (flash-attn-jax forks the
  FA2 kernels, whose causal mask and window are bottom-right anchored when Sq != Sk);
  ``window_size=(left, right)`` with ``-1`` = unbounded -> ``window`` with ``None`` for that side
  (``(-1, -1)`` = no window); GQA/MQA (fewer kv heads, contiguous groups) is the same.

What it refuses:
  a non-literal ``window_size``; a ``softmax_scale`` computed with array ops (flash-attn-jax asserts
  a Python float, and so does the contract); positional or keyword arguments outside this
  signature (forks add e.g. ``filter_nan``); splats.

Known problems:
  the bottom-right alignment is inherited from FA2 and not checked against a flash-attn-jax test.

Example::

    out = flash_mha(q, k, v, is_causal=True)
    # becomes
    out = flashport.attention(q, k, v, causal=True, align="bottom_right", layout="BSHD")
"""

from __future__ import annotations

from flashport.rules.base import Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import build_call, string
from flashport.rules.jax import shared as common

SIGNATURE = Signature(("q", "k", "v", "softmax_scale", "is_causal", "window_size"))


# The class attributes are the rule's manifest (rules/base.py Rule): every rule lists the same fields,
# so rules of one family read alike by design; the mapping they share lives in their helper module.
@register
class FlashAttnJaxMha(Rule):
    """Rewrite ``flash_attn_jax.flash_mha`` to ``flashport.attention`` (bottom-right causal)."""

    CODE = "FPA205"
    NAME = "flash-attn-jax-mha"
    SOURCES = ("flash_attn_jax.flash_mha", "flash_attn_jax.flash.flash_mha")
    GPU_MODULES = ("flash_attn_jax",)
    TARGET = "flashport.attention"

    def check_call(self, call, ctx):
        """Map FA2-style arguments to the contract, bottom-right aligned."""
        value = {name: arg.value for name, arg in SIGNATURE.bind(call, self.API).items()}
        q, k, v = common.require(value, ("q", "k", "v"), self.API)
        keywords = common.fa_keywords(value, ctx, self.API)
        keywords += [("align", string("bottom_right")), ("layout", string("BSHD"))]
        return Rewrite(build_call(self.TARGET, [q, k, v], keywords, call))
