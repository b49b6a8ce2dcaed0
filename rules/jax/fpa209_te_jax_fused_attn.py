"""FPA209 te-jax-fused-attn: TransformerEngine-JAX ``fused_attn`` (scan + refusal with reasons).

What it rewrites:
  nothing: ``transformer_engine.jax.attention.fused_attn(qkv, bias, sequence_descriptor, seed,
  attn_bias_type, attn_mask_type, qkv_layout, scaling_factor, dropout_probability, is_training,
  ...)`` (and the older ``transformer_engine.jax.fused_attn.fused_attn``) is reported. Its
  parameter list changed between TransformerEngine releases (the third parameter was ``mask``,
  later ``sequence_descriptor``; ``window_size_left/right`` became ``window_size``; ``softmax_type``
  was inserted), ``qkv`` is a 1-, 2- or 3-tuple whose packing depends on ``qkv_layout``, and TE's
  mask is **True = masked out**. A rewrite bound against the wrong release would silently change
  meaning, so sites are refused with the reason and the manual mapping.

Semantics mapping (for the manual port):
  ``scaling_factor`` (required; no default) -> ``scale``; ``AttnMaskType.CAUSAL_MASK`` ->
  ``causal=True, align="top_left"``; ``*_BOTTOM_RIGHT_MASK`` -> ``align="bottom_right"``;
  ``NO_MASK`` -> ``causal=False``; padding masks -> segment ids; a boolean mask -> ``mask=~mask``;
  ``QKVLayout.BSHD_BSHD_BSHD`` -> ``layout="BSHD"``; ``window_size=(l, r)`` -> ``window``;
  ``dropout_probability`` (when ``is_training``) -> ``dropout_rate`` with a PRNG key as
  ``dropout_rng`` (TE's ``seed`` is its own rng state, not that key).

What it refuses:
  every call; the reason names non-zero ``dropout_probability`` first, then the mask type found.

Example::

    out = fused_attn((q, k, v), None, seq_desc, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
                     QKVLayout.BSHD_BSHD_BSHD, 0.125, 0.0, False)
    # refused: "... AttnMaskType.CAUSAL_MASK -> causal=True, align='top_left' ..."
"""

from __future__ import annotations

from flashport.rules.base import Report, Rule, register
from flashport.rules.common.literals import is_zero
from flashport.rules.jax import shared as common

MASKS = {
    "NO_MASK": "causal=False",
    "PADDING_MASK": "segment ids",
    "CAUSAL_MASK": "causal=True, align='top_left'",
    "PADDING_CAUSAL_MASK": "causal=True, align='top_left' plus segment ids",
    "CAUSAL_BOTTOM_RIGHT_MASK": "causal=True, align='bottom_right'",
    "PADDING_CAUSAL_BOTTOM_RIGHT_MASK": "causal=True, align='bottom_right' plus segment ids",
}


@register
class TransformerEngineFusedAttn(Rule):
    """Report TransformerEngine-JAX ``fused_attn`` calls with why they are not rewritten."""

    CODE = "FPA209"
    NAME = "te-jax-fused-attn"
    SOURCES = ("transformer_engine.jax.attention.fused_attn", "transformer_engine.jax.fused_attn.fused_attn")
    TARGET = "flashport.attention (manual)"
    REWRITES = False

    def check_call(self, call, ctx):
        """Refuse with the blocking reason and the mask-type mapping found at this site."""
        value = {arg.keyword.value: arg.value for arg in call.args if arg.keyword is not None}
        positional = [arg.value for arg in call.args if arg.keyword is None and not arg.star]
        dropout = value.get("dropout_probability", positional[8] if len(positional) > 8 else None)
        if dropout is not None and not is_zero(dropout):
            head = (
                f"dropout_probability={ctx.code(dropout)} may be non-zero and TE's seed= (per-device rng state, "
                "gated by is_training) is not a PRNG key to carry: port with dropout_rate=/dropout_rng="
            )
        else:
            head = "TE fused_attn's parameter list differs between TransformerEngine releases and its mask is True = masked out: not rewritten"
        found = [
            common.enum_member(node, "AttnMaskType", tuple(MASKS))
            for node in list(value.values()) + positional
        ]
        mask = next((m for m in found if m), None)
        tail = (
            f"AttnMaskType.{mask} -> {MASKS[mask]}" if mask else "mask type not a literal AttnMaskType member"
        )
        return Report(
            f"{head}; {tail}; port by hand: flashport.attention(q, k, v, scale=scaling_factor, ...)"
        )
