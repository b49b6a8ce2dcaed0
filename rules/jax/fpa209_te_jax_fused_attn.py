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
  ``dropout_probability`` (when ``is_training``) -> ``dropout_rate`` with ``dropout_rng`` the PRNG
  key passed as ``seed`` (TE checks it is the uint32 data of a key and seeds cuDNN's dropout
  generator with its first two words: the port draws a different random mask, at the same rate).

What it refuses:
  every call (flashport has no ``fused_attn`` drop-in). The reason names what an explicit
  ``flashport.attention`` call could not state at the site: the release the call binds to (``mask=``
  until TE 2.0, ``sequence_descriptor=`` since 2.1), a mask type that is not a literal
  ``AttnMaskType`` member (computed at run time), and the dropout mapping when
  ``dropout_probability`` may be non-zero.

Example::

    out = fused_attn((q, k, v), None, seq_desc, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
                     QKVLayout.BSHD_BSHD_BSHD, 0.125, 0.0, False)
    # refused: "... AttnMaskType.CAUSAL_MASK -> causal=True, align='top_left' ..."
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Report, Rule, register
from flashport.rules.common.literals import is_none, is_zero, literal_bool, literal_number
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
    API = "transformer_engine.jax.attention.fused_attn"
    FRAMEWORK = "jax"
    SOURCES = ("transformer_engine.jax.attention.fused_attn", "transformer_engine.jax.fused_attn.fused_attn")
    TRIGGERS = (b"fused_attn",)
    TARGET = "flashport.attention (manual)"
    REWRITES = False

    def check_call(self, call, ctx):
        """Refuse with what blocks an explicit rewrite here and the manual mapping."""
        value = {arg.keyword.value: arg.value for arg in call.args if arg.keyword is not None}
        positional = [arg.value for arg in call.args if arg.keyword is None and not arg.star]

        def argument(name: str, index: int):
            return value.get(name, positional[index] if len(positional) > index else None)

        found = [
            common.enum_member(node, "AttnMaskType", tuple(MASKS))
            for node in list(value.values()) + positional
        ]
        mask = next((m for m in found if m), None)
        parts = ["TE fused_attn has no drop-in (its parameters changed between TransformerEngine releases)"]
        if "mask" in value:
            parts.append("mask= binds it to TE <= 2.0 (sequence_descriptor= since 2.1; True = masked out)")
        mask_type = argument("attn_mask_type", 5)
        if mask:
            parts.append(f"AttnMaskType.{mask} -> {MASKS[mask]}")
        elif mask_type is not None and not is_none(mask_type) and not isinstance(mask_type, cst.Attribute):
            parts.append(
                f"attn_mask_type={ctx.code(mask_type)} is not a literal AttnMaskType member (decided at run "
                "time), so no explicit flashport.attention call states it"
            )
        else:
            parts.append("mask type not a literal AttnMaskType member")
        dropout, training = argument("dropout_probability", 8), argument("is_training", 9)
        if dropout is not None and not is_zero(dropout) and literal_bool(training) is not False:
            seed = argument("seed", 3)
            gate = f" if {ctx.code(training)} else 0.0" if literal_bool(training) is None else ""
            key = ctx.code(seed) if seed is not None else "<key>"
            verb = "is" if literal_number(dropout) is not None else "may be"
            parts.append(
                f"dropout_probability={ctx.code(dropout)} {verb} non-zero: port with "
                f"dropout_rate={ctx.code(dropout)}{gate}, dropout_rng={key} (seed= is a PRNG key's uint32 "
                "data seeding cuDNN's dropout; the mask drawn differs, the rate does not)"
            )
        parts.append("port by hand: flashport.attention(q, k, v, scale=scaling_factor, ...)")
        return Report("; ".join(parts))
